"""cpu_graph: records on dummy inputs and replays like a CUDA graph, defects included.

Every test here would go red if the runner silently ran eager: each asserts something a
replay does and eager does not (a baked branch, no Python during replay, a stale buffer).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parity.runners import CaptureError, ReplayInputError, make_runner
from parity.runners.cpu_graph import CpuGraphRun
from serving_models.common import capture as capture_registry
from tests.support.runners_toys import (
    GEN_START,
    WIDTH,
    BranchFree,
    CapturingProbeRecorder,
    FlagBranch,
    HostRead,
    RepeatedCall,
    StaticCache,
    TwoExpertMoE,
    fake_modes_made,
)


def _cpu_graph(**knobs):
    return make_runner("cpu_graph", device="cpu", capture_registry=capture_registry, **knobs)


def test_replay_equals_eager_bitwise_for_a_branch_free_function():
    module = BranchFree()
    prepared = _cpu_graph().prepare(module.forward, (torch.randn(3, WIDTH),))
    generator = torch.Generator().manual_seed(11)
    for _ in range(3):
        x = torch.randn(3, WIDTH, generator=generator)
        with torch.no_grad():
            expected = module(x)
        # Bitwise: the replay runs the same ATen kernels on the same shapes as eager on the CPU.
        torch.testing.assert_close(prepared(x).output, expected, rtol=0, atol=0)


def test_python_branch_is_baked_at_capture():
    module = FlagBranch()
    prepared = _cpu_graph().prepare(module.forward, (torch.ones(3),))
    module.negate = True  # flipped after capture: eager follows it, the graph cannot
    x = torch.arange(3.0)
    replayed = prepared(x).output
    torch.testing.assert_close(replayed, x * 2, rtol=0, atol=0)
    assert not torch.equal(replayed, module(x)), "replay followed the new flag: the runner ran eager"


def test_host_branch_dispatch_bakes_the_dummy_batch_expert_7318():
    """vllm-project/vllm-omni#7318: captured on all-zero ids, a host-decided dispatch replays the und expert
    for a batch of gen tokens; the taps show which expert the graph actually used."""
    moe = TwoExpertMoE("host")
    ids = torch.full((3,), GEN_START + 1)
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(2))
    taps = {"und": moe.und, "gen": moe.gen}

    eager = make_runner("eager", device="cpu").prepare(moe.forward, (ids, x), taps=taps, host_prepare=moe.prepare_step)
    eager_result = eager(ids, x)
    assert len(eager_result.taps["gen"]) == 1 and not eager_result.taps["und"]

    graph = _cpu_graph().prepare(moe.forward, (ids, x), taps=taps, host_prepare=moe.prepare_step)
    assert not moe.batch_has_gen  # prepared on the all-zero dummy batch
    replayed = graph(ids, x)
    assert moe.batch_has_gen  # the host metadata is right for the real batch...
    # ...but the graph replays the expert chosen on the dummy batch.
    assert len(replayed.taps["und"]) == 1 and not replayed.taps["gen"]
    with torch.no_grad():
        torch.testing.assert_close(replayed.output, moe.und(x), rtol=0, atol=0)
        assert not torch.allclose(replayed.output, moe.gen(x))
    eager.close()
    graph.close()


def test_graph_safe_blend_captured_on_zeros_routes_gen_rows():
    """The fix of vllm-project/vllm-omni#9764 (both experts, `where` on the device) replays per-token routing."""
    moe = TwoExpertMoE("blend")
    ids = torch.tensor([0, GEN_START, 3, GEN_START + 5])
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(3))
    prepared = _cpu_graph().prepare(moe.forward, (ids, x))
    with torch.no_grad():
        expected = torch.where((ids >= GEN_START)[:, None], moe.gen(x), moe.und(x))
    torch.testing.assert_close(prepared(ids, x).output, expected, rtol=0, atol=0)


@pytest.mark.parametrize("pattern", HostRead.PATTERNS)
def test_host_read_while_capturing_raises_naming_the_module(pattern):
    module = HostRead(pattern)
    with pytest.raises(CaptureError, match=r"host read of a tensor value while capturing HostRead\.forward") as caught:
        _cpu_graph().prepare(module.forward, (torch.randn(4),))
    assert caught.value.site == "HostRead.forward"
    # The same code runs eagerly: the error is about capture, not about the function.
    make_runner("eager", device="cpu").prepare(module.forward, ())(torch.randn(4))


def test_host_read_error_names_the_given_site_and_leaves_no_patch_behind():
    with pytest.raises(CaptureError, match="while capturing model.layers.3.mlp"):
        _cpu_graph().prepare(HostRead("tolist").forward, (torch.randn(4),), name="model.layers.3.mlp")
    assert torch.tensor([1, 2]).tolist() == [1, 2]  # Tensor.tolist restored after the failed capture
    assert capture_registry.is_capturing("cpu") is False  # probe restored after the failed capture


def test_probe_reports_capturing_only_while_recording():
    module = CapturingProbeRecorder(capture_registry)
    x = torch.ones(2)
    make_runner("eager", device="cpu").prepare(module.forward, ())(x)
    assert module.answers == [False]

    prepared = _cpu_graph().prepare(module.forward, (x,))
    assert module.answers == [False, True]
    assert prepared.probe_during_capture is True
    assert capture_registry.is_capturing("cpu") is False

    torch.testing.assert_close(prepared(x + 1).output, (x + 1) * 3)
    assert module.answers == [False, True], "Python ran during a replay: the runner ran eager"


def test_registry_with_only_register_capture_probe_is_used():
    class RegisterOnly:
        def __init__(self):
            self.probe = None

        def register_capture_probe(self, backend, fn):
            previous, self.probe = self.probe, fn
            return previous

        def is_capturing(self, device):
            return bool(self.probe and self.probe())

    registry = RegisterOnly()
    module = CapturingProbeRecorder(registry)
    make_runner("cpu_graph", device="cpu", capture_registry=registry).prepare(module.forward, (torch.ones(2),))
    assert module.answers == [True]
    assert registry.probe is None


def test_without_a_registry_the_target_is_not_told_it_is_captured():
    module = CapturingProbeRecorder(capture_registry)
    make_runner("cpu_graph", device="cpu").prepare(module.forward, (torch.ones(2),))
    assert module.answers == [False]


def test_in_place_state_keeps_updating_on_replay():
    """A static cache written with index_copy_ inside the graph is written by every replay."""
    graph_cache, eager_cache = StaticCache(), StaticCache()
    prepared = _cpu_graph().prepare(graph_cache.forward, (torch.zeros(1, dtype=torch.long), torch.zeros(1, WIDTH)))
    generator = torch.Generator().manual_seed(4)
    for slot in (1, 2, 3):
        pos, x = torch.tensor([slot]), torch.randn(1, WIDTH, generator=generator)
        torch.testing.assert_close(prepared(pos, x).output, eager_cache(pos, x), rtol=0, atol=0)
    torch.testing.assert_close(graph_cache.cache, eager_cache.cache, rtol=0, atol=0)


def test_replay_without_copy_in_is_stale():
    module = BranchFree()
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected, dummy_output = module(x), module(torch.zeros_like(x))
    healthy = _cpu_graph().prepare(module.forward, (x,))
    torch.testing.assert_close(healthy(x).output, expected, rtol=0, atol=0)

    stale = _cpu_graph(copy_inputs=False).prepare(module.forward, (x,))
    stale_output = stale(x).output
    torch.testing.assert_close(stale_output, dummy_output, rtol=0, atol=0)
    assert not torch.allclose(stale_output, expected)


def test_poisoned_static_inputs_make_a_missing_copy_in_nan():
    module = BranchFree()
    x = torch.randn(2, WIDTH)
    healthy = _cpu_graph(poison_static_inputs=True).prepare(module.forward, (x,))
    assert torch.isfinite(healthy(x).output).all()
    stale = _cpu_graph(poison_static_inputs=True, copy_inputs=False).prepare(module.forward, (x,))
    assert torch.isnan(stale(x).output).all()


def test_copy_in_hook_is_what_a_mutant_overrides(monkeypatch):
    module = BranchFree()
    x = torch.randn(2, WIDTH)
    monkeypatch.setattr(CpuGraphRun, "_copy_in", lambda self, inputs: None)
    stale = _cpu_graph().prepare(module.forward, (x,))
    with torch.no_grad():
        torch.testing.assert_close(stale(x).output, module(torch.zeros_like(x)), rtol=0, atol=0)


def test_replay_at_another_shape_is_refused():
    prepared = _cpu_graph().prepare(BranchFree().forward, (torch.randn(2, WIDTH),))
    with pytest.raises(ReplayInputError, match=r"input 0 is \(3, 4\) torch.float32 but the graph was recorded at \(2, 4\)"):
        prepared(torch.randn(3, WIDTH))


def test_dummy_example_records_on_the_example_values():
    module = FlagBranch()
    prepared = _cpu_graph().prepare(module.forward, (torch.ones(2),), dummy="example")
    torch.testing.assert_close(prepared.static.buffers[0], torch.ones(2))
    zeros = _cpu_graph().prepare(module.forward, (torch.ones(2),))
    torch.testing.assert_close(zeros.static.buffers[0], torch.zeros(2))


def test_taps_list_every_call_and_are_fresh_on_each_replay():
    module = RepeatedCall()
    ids = torch.tensor([1, 5, 9])
    taps = {"embed": module.embed, "step": module.step}
    eager = make_runner("eager", device="cpu").prepare(module.forward, (ids,), taps=taps)
    graph = _cpu_graph().prepare(module.forward, (ids,), taps=taps)
    for real in (ids, torch.tensor([2, 3, 14])):
        expected, replayed = eager(real), graph(real)
        assert len(replayed.taps["step"]) == 3
        torch.testing.assert_close(replayed.taps["embed"][0].input, real, rtol=0, atol=0)
        for want, got in zip(expected.taps["step"], replayed.taps["step"], strict=True):
            torch.testing.assert_close(got.input, want.input, rtol=0, atol=0)
            torch.testing.assert_close(got.output, want.output, rtol=0, atol=0)
        torch.testing.assert_close(replayed.output, expected.output, rtol=0, atol=0)
    eager.close()
    graph.close()


def test_outputs_are_copies_not_the_graph_buffers():
    """An output aliasing module state (here the cache itself) must not change under the caller."""
    module = StaticCache()

    def step(pos, x):
        module(pos, x)
        return module.cache

    prepared = _cpu_graph().prepare(step, (torch.zeros(1, dtype=torch.long), torch.zeros(1, WIDTH)))
    kept = prepared(torch.tensor([0]), torch.ones(1, WIDTH)).output
    snapshot = kept.clone()
    prepared(torch.tensor([1]), torch.full((1, WIDTH), 5.0))
    assert module.cache[1].eq(5.0).all()  # the replay did write the state...
    torch.testing.assert_close(kept, snapshot, rtol=0, atol=0)  # ...but not into the returned copy


@dataclasses.dataclass
class _Pair:
    doubled: torch.Tensor
    layers: tuple[torch.Tensor, ...]


class _Opaque:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


def test_dataclass_outputs_replay_fresh_values_not_the_capture_time_ones() -> None:
    # A dataclass the pytree does not know would be one opaque leaf: every replay would hand back
    # the object built at capture, holding the dummy inputs' results.
    def fn(x: torch.Tensor) -> _Pair:
        return _Pair(x * 2, (x + 1, x + 2))

    prepared = make_runner("cpu_graph", device="cpu").prepare(fn, (torch.zeros(3),))
    result = prepared(torch.tensor([1.0, 2.0, 3.0])).output
    assert isinstance(result, _Pair)
    assert result.doubled.tolist() == [2.0, 4.0, 6.0] and result.layers[1].tolist() == [3.0, 4.0, 5.0]


def test_an_opaque_output_object_is_refused_rather_than_replayed_stale() -> None:
    with pytest.raises(Exception, match="cannot rebuild: \\['_Opaque'\\]"):
        make_runner("cpu_graph", device="cpu").prepare(lambda x: _Opaque(x * 2), (torch.zeros(3),))


def test_a_recording_builds_one_fake_mode():
    """Recording describes every value with one fake mode (`cpu_graph._one_fake_mode`), not one per
    value: those cost 40 % of recording the tiny decode step (docs/performance.md §1)."""

    def step(x):
        for _ in range(8):
            x = torch.tanh(x) * 2
        return x

    prepared = []
    made = fake_modes_made(lambda: prepared.append(_cpu_graph().prepare(step, (torch.zeros(4),))))
    assert made == 1, f"recording built {made} fake modes"
    torch.testing.assert_close(prepared[0](torch.ones(4)).output, step(torch.ones(4)), rtol=0, atol=0)

"""cuda_graph and compiled_cuda_graph on a real GPU (`pytest -m gpu`; skipped without CUDA).

Negative captures run in a fresh process (`capture_in_subprocess`): a failed synchronising
capture leaves this process's CUDA RNG unusable.
"""

from __future__ import annotations

import pytest
import torch

from parity.observe.compile_ledger import CompileLedger
from parity.runners import ReplayInputError, make_runner
from parity.runners.capture_isolated import capture_in_subprocess
from serving_models.common import capture as capture_registry
from tests.support.runners_toys import (
    GEN_START,
    WIDTH,
    BranchFree,
    CapturingProbeRecorder,
    RepeatedCall,
    StaticCache,
    TwoExpertMoE,
)

pytestmark = pytest.mark.parity_gpu

CUDA = "cuda"


def _graph(**knobs):
    return make_runner("cuda_graph", device=CUDA, capture_registry=capture_registry, **knobs)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(CUDA)


def test_cuda_graph_replay_equals_eager_for_a_branch_free_module():
    module = BranchFree().to(CUDA)
    prepared = _graph().prepare(module.forward, (_randn(3, WIDTH, seed=0),))
    for seed in (1, 2, 3):
        x = _randn(3, WIDTH, seed=seed)
        with torch.no_grad():
            expected = module(x)
        # Bitwise: a replay launches the kernels eager launched, on the same shapes.
        torch.testing.assert_close(prepared(x).output, expected, rtol=0, atol=0)


def test_cuda_graph_taps_match_eager_on_every_replay():
    module = RepeatedCall().to(CUDA)
    ids = torch.tensor([1, 5, 9], device=CUDA)
    taps = {"embed": module.embed, "step": module.step}
    eager = make_runner("eager", device=CUDA).prepare(module.forward, (ids,), taps=taps)
    graph = _graph().prepare(module.forward, (ids,), taps=taps)
    for real in (ids, torch.tensor([2, 3, 14], device=CUDA)):
        expected, replayed = eager(real), graph(real)
        torch.testing.assert_close(replayed.taps["embed"][0].input, real, rtol=0, atol=0)
        assert len(replayed.taps["step"]) == 3
        for want, got in zip(expected.taps["step"], replayed.taps["step"], strict=True):
            torch.testing.assert_close(got.output, want.output, rtol=0, atol=0)
    eager.close()
    graph.close()


def test_replay_without_copy_in_is_detected_as_stale():
    module = BranchFree().to(CUDA)
    x = _randn(2, WIDTH, seed=4)
    with torch.no_grad():
        expected, dummy_output = module(x), module(torch.zeros_like(x))
    torch.testing.assert_close(_graph().prepare(module.forward, (x,))(x).output, expected, rtol=0, atol=0)
    stale = _graph(copy_inputs=False).prepare(module.forward, (x,))(x).output
    torch.testing.assert_close(stale, dummy_output, rtol=0, atol=0)
    assert not torch.allclose(stale, expected)
    poisoned = _graph(copy_inputs=False, poison_static_inputs=True).prepare(module.forward, (x,))(x).output
    assert torch.isnan(poisoned).all()


def test_host_branch_dispatch_bakes_the_dummy_batch_expert_7318():
    moe = TwoExpertMoE("host").to(CUDA)
    ids = torch.full((3,), GEN_START + 1, device=CUDA)
    x = _randn(3, WIDTH, seed=5)
    graph = _graph().prepare(moe.forward, (ids, x), taps={"und": moe.und, "gen": moe.gen}, host_prepare=moe.prepare_step)
    replayed = graph(ids, x)
    assert moe.batch_has_gen
    assert len(replayed.taps["und"]) == 1 and not replayed.taps["gen"]
    with torch.no_grad():
        torch.testing.assert_close(replayed.output, moe.und(x), rtol=0, atol=0)


def test_graph_safe_blend_captured_on_zeros_routes_gen_rows():
    moe = TwoExpertMoE("blend").to(CUDA)
    ids = torch.tensor([0, GEN_START, 3, GEN_START + 5], device=CUDA)
    x = _randn(4, WIDTH, seed=6)
    with torch.no_grad():
        expected = torch.where((ids >= GEN_START)[:, None], moe.gen(x), moe.und(x))
    torch.testing.assert_close(_graph().prepare(moe.forward, (ids, x))(ids, x).output, expected, rtol=0, atol=0)


def test_target_sees_capturing_only_during_capture():
    module = CapturingProbeRecorder(capture_registry)
    prepared = _graph(warmup_iters=2).prepare(module.forward, (torch.ones(2, device=CUDA),))
    assert prepared.probe_during_capture is True
    assert module.answers == [False, False, True]  # two side-stream warm-ups, then the capture
    prepared(torch.ones(2, device=CUDA))
    assert module.answers == [False, False, True], "Python ran during a replay: the runner ran eager"


def test_in_place_state_keeps_updating_on_replay():
    graph_cache, eager_cache = StaticCache().to(CUDA), StaticCache().to(CUDA)
    prepared = _graph(warmup_iters=1).prepare(
        graph_cache.forward, (torch.zeros(1, dtype=torch.long, device=CUDA), torch.zeros(1, WIDTH, device=CUDA))
    )
    for slot in (1, 2, 3):
        pos, x = torch.tensor([slot], device=CUDA), _randn(1, WIDTH, seed=slot)
        torch.testing.assert_close(prepared(pos, x).output, eager_cache(pos, x), rtol=0, atol=0)
    torch.testing.assert_close(graph_cache.cache, eager_cache.cache, rtol=0, atol=0)


def test_replay_at_another_shape_is_refused():
    prepared = _graph().prepare(BranchFree().to(CUDA).forward, (torch.randn(2, WIDTH, device=CUDA),))
    with pytest.raises(ReplayInputError, match="recorded at"):
        prepared(torch.randn(3, WIDTH, device=CUDA))


def test_compiled_cuda_graph_matches_eager():
    module = BranchFree().to(CUDA)
    x = _randn(3, WIDTH, seed=7)
    with CompileLedger() as ledger:
        prepared = make_runner("compiled_cuda_graph", device=CUDA, ledger=ledger).prepare(module.forward, (x,))
        got = prepared(x).output
    with torch.no_grad():
        expected = module(x)
    # Inductor fuses the pointwise tail (silu, add): 1e-5 as for eager vs Inductor on the CPU
    # (docs/tolerances.md §1); the matmuls are the same cuBLAS calls.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert ledger.compiles(BranchFree.forward) == 1  # compiled during warm-up, not per replay
    assert ledger.calls(BranchFree.forward) == 4  # 3 warm-ups + the capture; replays run no Python


def test_capturing_a_host_sync_fails_in_a_subprocess_naming_the_module():
    outcome = capture_in_subprocess("tests.support.runners_toys:host_sync_case_cuda")
    assert outcome.captured is False, outcome.stderr_tail
    assert outcome.error_type == "CaptureError"
    assert "CUDA graph capture of HostRead.forward failed" in outcome.message


def test_a_tensor_if_under_capture_fails_naming_the_given_site():
    outcome = capture_in_subprocess("tests.support.runners_toys:tensor_if_case_cuda")
    assert outcome.captured is False, outcome.stderr_tail
    assert "CUDA graph capture of decoder.layers.2.mlp failed" in outcome.message


def test_a_clean_module_captures_in_a_subprocess():
    outcome = capture_in_subprocess("tests.support.runners_toys:branch_free_case_cuda")
    assert outcome.captured is True, outcome.message
    assert outcome.rng_usable_after is True

"""The one runner interface across the CPU modes, the compiled mode, and the isolated capture helper."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from parity.observe.compile_ledger import CompileLedger
from parity.runners import CPU_MODES, GPU_MODES, MODES, CaptureError, RunResult, make_runner, modes_for
from parity.runners.capture_isolated import capture_in_subprocess
from serving_models.common import capture as capture_registry
from tests.support.runners_toys import GEN_START, WIDTH, BranchFree, HostRead, RepeatedCall, TwoExpertMoE

# aot_eager: runs Dynamo and AOTAutograd (the parts that bake, guard and break graphs) without
# Inductor's C++ build, which takes seconds per graph on this 2-core machine; one test below
# uses Inductor itself.
FAST_BACKEND = "aot_eager"


def test_a_recorded_graph_takes_its_tap_hooks_off_the_modules():
    """Two graphs recorded over the same modules (as the keyed decode graphs are): the first's hooks
    are gone once it is recorded, so the second's capture does not record into the first's taps
    (under Dynamo each such call failed a guard on the store and recompiled, up to the limit)."""
    module = RepeatedCall()
    ids = torch.tensor([1, 4, 15])
    taps = {"embed": module.embed, "step": module.step}
    first = make_runner("cpu_graph", device="cpu").prepare(module.forward, (ids,), taps=taps)
    assert not module.step._forward_hooks and not module.embed._forward_hooks
    second = make_runner("cpu_graph", device="cpu").prepare(module.forward, (ids,), taps=taps)
    module(ids)  # an eager call between replays records nowhere
    assert [len(first(ids).taps[k]) for k in taps] == [1, 3] == [len(second(ids).taps[k]) for k in taps]
    first.close()
    second.close()


@pytest.mark.parametrize("mode", CPU_MODES)
def test_every_cpu_mode_matches_eager_with_taps(mode):
    module = RepeatedCall()
    ids = torch.tensor([1, 4, 15])
    taps = {"embed": module.embed, "step": module.step}
    eager = make_runner("eager", device="cpu").prepare(module.forward, (ids,), taps=taps)
    prepared = make_runner(mode, device="cpu", backend=FAST_BACKEND).prepare(module.forward, (ids,), taps=taps)
    assert prepared.mode == mode
    for real in (ids, torch.tensor([0, 7, 3])):
        expected, got = eager(real), prepared(real)
        assert isinstance(got, RunResult)
        # aot_eager and the recorded graph run the same ATen ops as eager: bitwise on the CPU.
        torch.testing.assert_close(got.output, expected.output, rtol=0, atol=0)
        assert [len(got.taps[k]) for k in taps] == [1, 3]
        torch.testing.assert_close(got.taps["embed"][0].input, real, rtol=0, atol=0)
        for want, have in zip(expected.taps["step"], got.taps["step"], strict=True):
            torch.testing.assert_close(have.output, want.output, rtol=0, atol=0)
    prepared.close()
    eager.close()


def test_compiled_mode_compiles_at_prepare_and_runs_compiled_code():
    module = BranchFree()
    with CompileLedger() as ledger:
        prepared = make_runner("compiled", device="cpu", backend=FAST_BACKEND, ledger=ledger).prepare(
            module.forward, (torch.randn(3, WIDTH),), taps={"up": module.up}
        )
        assert ledger.compiles(BranchFree.forward) == 1  # compiled by prepare, on the dummy inputs
        for rows in (3, 5, 7):  # dynamic=True: one graph for every size >= 2
            x = torch.randn(rows, WIDTH)
            torch.testing.assert_close(prepared(x).taps["up"][0].input, x, rtol=0, atol=0)
    # The tap hooks and their store (cleared before each call) add no guard that recompiles.
    assert ledger.compiles(BranchFree.forward) == 1
    assert ledger.calls(BranchFree.forward) == 4  # prepare's call + 3
    assert not ledger.eager_fallbacks()


def test_compiled_mode_with_inductor_matches_eager():
    module = BranchFree()
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(9))
    prepared = make_runner("compiled", device="cpu").prepare(module.forward, (x,))
    with torch.no_grad():
        expected = module(x)
    # Inductor fuses the pointwise tail (silu, add) and may contract to FMAs: 1e-5, as vllm-omni's
    # DiT parity test uses for eager vs Inductor on the CPU (docs/tolerances.md §1).
    torch.testing.assert_close(prepared(x).output, expected, rtol=1e-5, atol=1e-5)


def test_compiled_mode_is_fullgraph_so_a_host_branch_is_an_error_not_a_split():
    module = HostRead("tensor_if")
    with pytest.raises(Exception, match="(?s)Data-dependent.*while compiling HostRead.forward") as caught:
        make_runner("compiled", device="cpu", backend=FAST_BACKEND).prepare(module.forward, (torch.randn(4),))
    assert "fullgraph=True" in "\n".join(getattr(caught.value, "__notes__", []))


def test_compiled_mode_traces_the_graph_safe_blend_with_taps():
    moe = TwoExpertMoE("blend")
    ids = torch.tensor([0, GEN_START + 2, 5])
    x = torch.randn(3, WIDTH)
    taps = {"und": moe.und, "gen": moe.gen}
    got = make_runner("compiled", device="cpu", backend=FAST_BACKEND).prepare(moe.forward, (ids, x), taps=taps)(ids, x)
    with torch.no_grad():
        torch.testing.assert_close(got.taps["gen"][0].output, moe.gen(x), rtol=0, atol=0)
        torch.testing.assert_close(got.taps["und"][0].output, moe.und(x), rtol=0, atol=0)


def test_eager_mode_calls_host_prepare_before_every_call():
    moe = TwoExpertMoE("host")
    run = make_runner("eager", device="cpu").prepare(moe.forward, (), host_prepare=moe.prepare_step)
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        torch.testing.assert_close(run(torch.full((2,), GEN_START), x).output, moe.gen(x))
        torch.testing.assert_close(run(torch.zeros(2, dtype=torch.long), x).output, moe.und(x))


def test_taps_are_taken_off_when_a_run_closes():
    module = nn.Linear(2, 2)
    run = make_runner("eager", device="cpu").prepare(module.forward, (), taps={"lin": module})
    assert len(module._forward_hooks) == 1
    run.close()
    assert len(module._forward_hooks) == 0


def test_a_failed_prepare_leaves_no_hooks():
    module = HostRead("item")
    with pytest.raises(CaptureError):
        make_runner("cpu_graph", device="cpu").prepare(module.forward, (torch.randn(4),), taps={"me": module})
    assert len(module._forward_hooks) == 0


def test_site_name_defaults_to_the_bound_module_and_method():
    with pytest.raises(Exception, match="while capturing HostRead.forward"):
        make_runner("cpu_graph", device="cpu").prepare(HostRead("item").forward, (torch.randn(4),))

    def free_function(x):
        return x * x.sum().item()

    with pytest.raises(
        Exception, match="while capturing test_site_name_defaults_to_the_bound_module_and_method.<locals>.free_function"
    ):
        make_runner("cpu_graph", device="cpu").prepare(free_function, (torch.randn(4),))

    def scaled(x, factor):
        return x * factor * x.sum().item()

    with pytest.raises(Exception, match=r"while capturing test_site_name.*\.<locals>\.scaled"):
        make_runner("cpu_graph", device="cpu").prepare(functools.partial(scaled, factor=2.0), (torch.randn(4),))


def test_make_runner_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="unknown runner mode 'jit'"):
        make_runner("jit", device="cpu")
    with pytest.raises(ValueError, match="runs on cuda, got cpu; on the CPU use cpu_graph"):
        make_runner("cuda_graph", device="cpu")
    with pytest.raises(TypeError, match="unknown option"):
        make_runner("cpu_graph", device="cpu", copy_input=False)
    assert make_runner("compiled+cuda_graph", device="cuda").mode == "compiled_cuda_graph"


def test_mode_lists():
    assert set(CPU_MODES) | set(GPU_MODES) == set(MODES)
    assert modes_for("cpu") == CPU_MODES
    assert modes_for("cuda:0") == GPU_MODES


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_isolated_capture_reports_the_failure_and_names_the_module():
    failed = capture_in_subprocess("tests.support.runners_toys:host_read_case_cpu", mode="cpu_graph", device="cpu")
    assert failed.captured is False
    assert failed.error_type == "CaptureError"
    assert "while capturing HostRead.forward" in failed.message
    assert failed.returncode == 0
    # The positive control (a clean case captures in the child) runs on the GPU lane only: each
    # child pays a torch import, several seconds on the CPU lane's 2 cores.


def test_probe_registry_is_left_as_found_after_every_mode():
    for mode in CPU_MODES:
        make_runner(mode, device="cpu", capture_registry=capture_registry, backend=FAST_BACKEND).prepare(
            BranchFree().forward, (torch.randn(2, WIDTH),)
        )
        assert capture_registry.is_capturing("cpu") is False

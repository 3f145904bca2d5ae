"""The AR backbone under real CUDA graphs, and the full-size (Preview) widths on a GPU.

Negative capture checks run in a fresh interpreter: a failed capture can poison the process's
CUDA state (docs/capture-and-compile.md §1).
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from parity.suites.ar import golden as ar_golden
from parity.suites.ar.support import full_size_need
from parity.suites.conftest import RESIDENT
from parity.suites.device_memory import DeviceMemoryError, require_device_bytes
from reference_models.ar.adapter import ReferenceARAdapter
from reference_models.ar.config import ar_config
from reference_models.checkpoints import random_state_dict
from serving_models.ar.adapter import ServingARAdapter
from tests.support.ar_support import GEN_LAST, SEED, START
from tests.support.helpers import run_command
from tests.support.noise_checks import assert_same_greedy

pytestmark = pytest.mark.parity_gpu
REPO = Path(__file__).resolve().parents[2]


def cuda_graph_step(adapter: ServingARAdapter, batch: int, max_len: int) -> Callable:
    """Capture `decode_step` on all-zero ids (warm-up on a side stream first); return a replaying step."""
    adapter.allocate_decode_state(batch, max_len)
    static_ids = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    static_positions = torch.zeros(batch, dtype=torch.long, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            adapter.decode_step(static_ids, static_positions)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits = adapter.decode_step(static_ids, static_positions)

    def step(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        static_ids.copy_(ids)
        static_positions.copy_(positions)
        graph.replay()
        return static_logits.clone()

    return step


def test_cuda_graph_decode_replays_gen_tokens_on_tiny() -> None:
    config = ar_config("tiny")
    state = random_state_dict(config, SEED, "cuda")
    captured = ServingARAdapter.build(config, state, "cuda")
    eager = ServingARAdapter.build(config, state, "cuda")
    reference = ReferenceARAdapter.build(config, state, "cuda")
    step = cuda_graph_step(captured, batch=2, max_len=12)
    prompt = torch.tensor([[5, 9, 262, 300], [7, 8, 9, 10]], device="cuda")
    replayed = captured.greedy_generate(prompt, 6, step_fn=step)
    want = eager.greedy_generate(prompt, 6)
    # the graph blends all rows, eager gathers mixed rows per expert: GEMM-shape rounding only, so
    # step logits at fp32 noise and tokens equal up to a tie flip (tests/support/noise_checks.py)
    assert_same_greedy(want, replayed)
    assert_same_greedy(reference.greedy_generate(prompt, 6), replayed)
    # a gen token fed to the graph captured on zeros takes gen_mlp: compare with forcing it to und
    captured.prefill(prompt)
    logits = step(torch.tensor([[GEN_LAST], [START]], device="cuda"), torch.full((2,), 4, device="cuda"))
    sequence = torch.cat([prompt, torch.tensor([[GEN_LAST], [START]], device="cuda")], dim=1)
    forced = sequence >= START
    forced[:, -1] = False
    und_only = reference.forward(inputs_embeds=reference.embed(sequence), gen_token_mask=forced).logits[:, -1]
    torch.testing.assert_close(logits, reference.forward(sequence).logits[:, -1])
    assert ((logits - und_only).abs().amax(-1) > 1e-3).all()


def test_cuda_capture_without_mask_fails_closed() -> None:
    code = textwrap.dedent(
        """
        import torch
        from reference_models.ar.config import ar_config
        from reference_models.checkpoints import random_state_dict
        from serving_models.ar.adapter import ServingARAdapter
        config = ar_config("tiny")
        adapter = ServingARAdapter.build(config, random_state_dict(config, 0, "cuda"), "cuda")
        embeds = adapter.embed(torch.zeros(1, 4, dtype=torch.long, device="cuda"))
        adapter.forward(inputs_embeds=embeds)  # warm-up, eager: und everywhere
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                adapter.forward(inputs_embeds=embeds)
        except RuntimeError as err:
            print("RAISED:", err)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = run_command([sys.executable, "-c", code], cwd=REPO, env=env)
    assert "RAISED: model.layers.2" in result.stdout, result.stdout + result.stderr
    assert "enforce_eager" in result.stdout and "PIECEWISE is not a workaround" in result.stdout


@pytest.mark.parity_slow
def test_full_size_bf16_against_fp64_golden() -> None:
    """Preview widths (10.7e9 parameters): bf16 serving vs bf16 reference, both against the streamed
    fp64 golden (docs/lanes.md §4), which never holds more than one unit's fp64 weights: an 80 GB
    card runs it (the whole fp64 golden alone would need 79.7 GiB)."""
    config = ar_config("full")
    RESIDENT.release()  # in a lane session the suites' last full-size family (the DiT) leaves the card first
    try:
        require_device_bytes("full-size AR", full_size_need(config, torch.bfloat16), torch.device("cuda"))
    except DeviceMemoryError as err:
        pytest.skip(str(err))
    ids = torch.tensor([[151644, 872, 198, 152064, 152065, 152071, 152100, 184863, 3, 152064]], device="cuda")
    with torch.no_grad():
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        golden = ar_golden.from_draws(config, SEED, "cuda")
        golden_logits = golden.forward(ids).logits
        added = torch.cuda.max_memory_allocated() - before
        # one unit at a time: the largest unit with its fp32 draw, plus megabytes of activations
        # for 10 tokens; a unit left in place after its forward would add a second unit and more
        largest = ar_golden.unit_bytes(config, torch.float64)
        assert golden.streamed.peak_units == 1 and added < 2 * largest, (added, largest)
        assert all(p.is_meta for p in golden.module.parameters())
        del golden
        state = random_state_dict(config, SEED, "cuda", torch.bfloat16)
        ref_logits = ReferenceARAdapter.build(config, state, "cuda", torch.bfloat16).forward(ids).logits
        serving = ServingARAdapter.build(config, state, "cuda", torch.bfloat16)
        srv_logits = serving.forward(ids).logits
    print(f"streamed fp64 golden: {added / 2**30:.2f} GiB at its peak (largest unit {largest / 2**30:.2f} GiB with its draw)")
    assert srv_logits.shape == (1, ids.shape[1], 152064 + 32800)
    ref_err = (ref_logits.double() - golden_logits).pow(2).mean().sqrt().item()
    srv_err = (srv_logits.double() - golden_logits).pow(2).mean().sqrt().item()
    print(f"full bf16 rmse vs fp64 golden: reference {ref_err:.4e}, serving {srv_err:.4e}, ratio {srv_err / ref_err:.3f}")
    # docs/tolerances.md §2: bf16 multiplier 3 (torch._dynamo.utils.same), plus tol/10 with tol 1e-2
    assert srv_err <= 3 * ref_err + 1e-3

    # decode: a graph captured on zeros replays equal to the eager step (batch 1: both run the
    # chosen expert on the same single row, so the same kernels on the same shapes)
    step = cuda_graph_step(serving, batch=1, max_len=16)
    eager = ServingARAdapter(serving.module)
    serving.prefill(ids)
    eager.decode_state = serving.decode_state.clone()
    for i, token in enumerate([152064, 500, 152200]):
        t = torch.tensor([[token]], device="cuda")
        pos = torch.full((1,), ids.shape[1] + i, device="cuda")
        assert torch.equal(step(t, pos), eager.decode_step(t, pos)), (i, token)

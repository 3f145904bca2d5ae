"""The serving router on CUDA: real CUDA-graph capture with a device-side count, batch invariance
and parity with the reference on the same device. Skipped without CUDA."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

import serving_models.routing.router as serving_routing
from reference_models.routing import router as reference_routing
from tests.support.helpers import run_command
from tests.support.noise_checks import routing_tie_flips

pytestmark = pytest.mark.parity_gpu

CAPACITY, NUM_EXPERTS = 64, 256
# docs/routing.md §2: cross-implementation weight bound (ATOM / vLLM top-k tests).
WEIGHT_ATOL = 2e-5

CASES = {
    "softmax": dict(renormalize=False, num_shared_experts=1),
    "grouped": dict(
        scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=4, routed_scaling_factor=2.5, num_shared_experts=1
    ),
}


def route(case: str, logits, count, bias):
    extra = dict(correction_bias=bias) if case == "grouped" else {}
    return serving_routing.select_experts(logits, 8, num_valid_rows=count, **CASES[case], **extra)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_graph_replay_follows_the_device_count(case):
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(21)
    logits = torch.zeros(CAPACITY, NUM_EXPERTS, device=device)
    count = torch.full((1,), CAPACITY, dtype=torch.int32, device=device)
    bias = -torch.rand(NUM_EXPERTS, device=device, generator=generator) - 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            route(case, logits, count, bias)  # warm-up off the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = route(case, logits, count, bias)
    for n in (CAPACITY, CAPACITY // 2, 1, 0, CAPACITY, -1, CAPACITY + 3):
        logits.copy_(torch.randn(CAPACITY, NUM_EXPERTS, device=device, generator=generator).to(torch.bfloat16).float())
        logits[max(n, 0) :] = float("nan")
        count.fill_(n)
        graph.replay()
        eager = route(case, logits, count, bias)
        real = min(max(n, 0), CAPACITY)
        assert (static_out.ids[real:] == -1).all(), f"n_valid={n}: pad rows routed in the replay"
        assert torch.equal(static_out.ids, eager.ids) and torch.equal(static_out.weights, eager.weights), n


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_serving_equals_reference(case, dtype):
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(22)
    logits = (2 * torch.randn(513, NUM_EXPERTS, device=device, generator=generator)).to(dtype)
    bias = -torch.rand(NUM_EXPERTS, device=device, generator=generator) - 1
    count = torch.tensor([500], dtype=torch.int32, device=device)
    extra = dict(correction_bias=bias) if case == "grouped" else {}
    got = serving_routing.select_experts(logits, 8, num_valid_rows=count, **CASES[case], **extra)
    want = reference_routing.select_experts(logits, 8, num_valid_rows=count, **CASES[case], **extra)
    assert torch.equal(got.ids, want.ids)
    assert (got.weights - want.weights).abs().max().item() <= WEIGHT_ATOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_batch_invariance(case):
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(23)
    bias = -torch.rand(NUM_EXPERTS, device=device, generator=generator) - 1
    pool = torch.randn(4104, NUM_EXPERTS, device=device, generator=generator)
    pool[::4] = pool[::4].round()
    alone = route(case, pool[:8], None, bias)
    for rows in (1, 8, 64, 512, 4096):
        batch = torch.cat([pool[8 : 8 + rows], pool[:8]])
        result = route(case, batch, torch.tensor([rows + 8], dtype=torch.int32, device=device), bias)
        assert torch.equal(result.ids[rows:], alone.ids) and torch.equal(result.weights[rows:], alone.weights), rows


def test_cuda_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    device = torch.device("cuda")
    logits = torch.randn(CAPACITY, NUM_EXPERTS, device=device)
    bias = -torch.rand(NUM_EXPERTS, device=device) - 1
    count = torch.tensor([40], dtype=torch.int32, device=device)
    compiled = torch.compile(lambda x, n, b: tuple(route("grouped", x, n, b)), fullgraph=True)
    got, want = compiled(logits, count, bias), route("grouped", logits, count, bias)
    # Inductor computes the keys with its own sigmoid: ids equal up to a tie flip, pad rows exactly -1.
    options = dict(CASES["grouped"], correction_bias=bias)
    flips = routing_tie_flips(logits[:40], want.ids[:40], got[1][:40], 8, options)
    assert torch.equal(got[1][40:], want.ids[40:])
    kept = torch.ones(CAPACITY, dtype=torch.bool, device=device)
    kept[flips] = False
    # Inductor's generated exp / fused arithmetic vs ATen's: a few fp32 ulps of weights <= 2.5.
    assert (got[0][kept] - want.weights[kept]).abs().max().item() <= 1e-6
    torch._dynamo.reset()


HOST_READ_CAPTURE = textwrap.dedent(
    """
    import torch, serving_models.routing.router as r
    def host_read(n, rows):
        return torch.full((1,), min(max(int(n.reshape(-1)[0]), 0), rows), dtype=torch.int64, device=n.device)
    r.valid_row_count = host_read
    x = torch.randn(16, 32, device="cuda"); n = torch.tensor([8], dtype=torch.int32, device="cuda")
    r.select_experts(x, 4, renormalize=True, num_valid_rows=n)  # eager works
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            r.select_experts(x, 4, renormalize=True, num_valid_rows=n)
    except Exception as error:
        print("CAPTURE_FAILED", type(error).__name__)
    else:
        print("CAPTURED")
    """
)


def test_host_read_count_fails_cuda_capture():
    # A fresh process: a failed capture poisons the CUDA context (docs/capture-and-compile.md §1).
    repo_root = Path(__file__).resolve().parents[2]
    done = run_command([sys.executable, "-c", HOST_READ_CAPTURE], cwd=repo_root)
    assert "CAPTURE_FAILED" in done.stdout, done.stdout + done.stderr

"""Timings of the tiny AR backbone on the CPU lane (pytest-benchmark; measured, never asserted).

Run without xdist: `pytest tests/models/bench_ar_forward.py -p no:xdist`.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.ar_support import mixed_ids


@pytest.mark.benchmark
@pytest.mark.parametrize("target", ["reference", "serving"])
def test_bench_tiny_forward(benchmark, request, target) -> None:
    adapter = request.getfixturevalue(target)
    ids = mixed_ids(batch=2, length=32)
    out = benchmark(adapter.forward, ids)
    assert out.logits.shape == (2, 32, 320)


@pytest.mark.benchmark
def test_bench_tiny_serving_decode_step(benchmark, serving) -> None:
    serving.allocate_decode_state(2, 64)
    serving.prefill(mixed_ids(batch=2, length=32))
    ids, positions = torch.tensor([[300], [5]]), torch.full((2,), 32)
    logits = benchmark(serving.decode_step, ids, positions)
    assert logits.shape == (2, 320)

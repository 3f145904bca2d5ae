"""Timings of the serving router (pytest-benchmark; never asserted). Run with `-p no:xdist`."""

from __future__ import annotations

import pytest
import torch

from reference_models.routing import router as reference_routing
from serving_models.routing import router as serving_routing

ROWS, NUM_EXPERTS, K = 512, 256, 8


def grouped_inputs():
    generator = torch.Generator().manual_seed(31)
    logits = torch.randn(ROWS, NUM_EXPERTS, generator=generator)
    bias = -torch.rand(NUM_EXPERTS, generator=generator) - 1
    kwargs = dict(
        scoring="sigmoid",
        renormalize=True,
        correction_bias=bias,
        num_expert_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        num_valid_rows=torch.tensor([500], dtype=torch.int32),
    )
    return logits, kwargs


@pytest.mark.benchmark(group="routing")
@pytest.mark.parametrize("router", ["serving", "reference"])
def test_grouped_routing_time(benchmark, router):
    logits, kwargs = grouped_inputs()
    select = serving_routing.select_experts if router == "serving" else reference_routing.select_experts
    result = benchmark.pedantic(select, args=(logits, K), kwargs=kwargs, rounds=3, iterations=1)
    assert tuple(result.ids.shape) == (ROWS, K)

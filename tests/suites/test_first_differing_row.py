"""The half-precision rule of numerics' first-differing-row check (`_first_row_above_noise`):
rounding between two runs of the same model stays below it, another expert's row does not."""

from __future__ import annotations

import torch

from parity.suites.ar.test_numerics import _first_row_above_noise

GOLDEN = torch.randn(1, 6, 512, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def bf16_run(seed: int) -> torch.Tensor:
    """The golden plus noise of 1e-2 (rounding of other kernels and shapes), rounded to bf16."""
    noise = 1e-2 * torch.randn(GOLDEN.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (GOLDEN + noise).to(torch.bfloat16)


def test_rounding_between_two_runs_is_not_a_difference_and_another_expert_is() -> None:
    reference, routed, und_only = bf16_run(1), bf16_run(2), bf16_run(3)
    assert _first_row_above_noise(routed, und_only, reference, GOLDEN) == [None]
    other_expert = und_only.clone()
    other_expert[0, 3:] += 0.3  # from position 3 on the other expert's output
    assert _first_row_above_noise(routed, other_expert, reference, GOLDEN) == [3]


def test_an_early_row_on_the_wrong_expert_is_the_first_difference() -> None:
    reference, routed = bf16_run(1), bf16_run(2)
    wrong = routed.clone()
    wrong[0, 0] += 0.3  # position 0 routed to the other expert
    assert _first_row_above_noise(wrong, routed, reference, GOLDEN) == [0]

"""The image suite's measured bound (`parity.suites.dit.support.image_bound`): relative to the
comparison image's distance from the fp64 golden, with the fp32 floor of one-level differences."""

from __future__ import annotations

import math

import numpy as np
import pytest

from parity.compare.images import psnr
from parity.suites.dit.support import ImageThreshold, image_bound, image_threshold

SHAPE = (256, 256, 3)


def flipped(image: np.ndarray, count: int, seed: int, levels: int = 1) -> np.ndarray:
    """`image` with `count` values moved by `levels` grey levels (rounding flips when levels is 1)."""
    out = image.astype(np.int16).reshape(-1)
    index = np.random.default_rng(seed).choice(out.size, size=count, replace=False)
    out[index] += np.where(out[index] < 128, levels, -levels)
    return out.reshape(image.shape).astype(np.uint8)


@pytest.fixture(scope="module")
def golden() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=SHAPE, dtype=np.uint8)


def test_fp32_bound_is_finite_when_the_comparison_equals_the_golden(golden: np.ndarray) -> None:
    fp32 = image_threshold("fp32")
    bound, how = image_bound(golden, golden.copy(), fp32)  # PSNR inf: taken as 10 one-level differences
    floor = 10 * math.log10(255.0**2 * golden.size / fp32.min_noise_values)
    assert bound == pytest.approx(floor - fp32.golden_max_drop_db) and 81 < bound < 82
    assert "taken as" in how and "10 one-level differences" in how
    # a correct fp32 candidate flips a few values (3-16 measured): inside the bound
    assert psnr(golden, flipped(golden, 16, 1), data_range=255.0).value >= bound
    # a schedule defect that costs 40 dB (images at 52-54 dB against the golden): 65k values one level off, outside
    defect = flipped(golden, 65_000, 2)
    assert 52 < psnr(golden, defect, data_range=255.0).value < bound - 25


def test_a_comparison_above_the_floor_sets_the_bound_itself(golden: np.ndarray) -> None:
    fp32 = image_threshold("fp32")
    comparison = flipped(golden, 500, 3)  # 500 one-level differences: more than the floor's 10
    measured = psnr(golden, comparison, data_range=255.0).value
    bound, how = image_bound(golden, comparison, fp32)
    assert bound == pytest.approx(measured - fp32.golden_max_drop_db) and "taken as" not in how
    # 3x the comparison's RMSE is 9x its squared error: 4500 flips sit at the bound, 9000 below it
    assert psnr(golden, flipped(golden, 4000, 4), data_range=255.0).value >= bound
    assert psnr(golden, flipped(golden, 9000, 5), data_range=255.0).value < bound


def test_without_a_floor_the_bound_follows_the_comparison_alone(golden: np.ndarray) -> None:
    bf16_like = ImageThreshold(reason="test: no floor", golden_max_drop_db=9.54)
    assert image_bound(golden, golden.copy(), bf16_like)[0] == math.inf  # identical: nothing may differ
    comparison = flipped(golden, 20_000, 6)
    measured = psnr(golden, comparison, data_range=255.0).value
    assert image_bound(golden, comparison, bf16_like)[0] == pytest.approx(measured - 9.54)


def test_image_thresholds_are_validated() -> None:
    with pytest.raises(ValueError, match="min_noise_values"):
        ImageThreshold(reason="r", golden_max_drop_db=9.54, min_noise_values=0)
    with pytest.raises(ValueError, match="golden_max_drop_db"):
        ImageThreshold(reason="r", golden_max_drop_db=-1.0)

"""The sampler's schedule bit for bit against independent float32 computations of the release's.

The release (bytedance/mammothmoda, numpy pinned at 1.26.4) builds the grid with
`np.linspace(0, 1, N + 1, dtype=np.float32)[:-1]` and shifts it with `m = np.sqrt(h*w) / 40`, a
float64 scalar that numpy 1.x's value-based promotion rounds to float32 before the float32 array
arithmetic `t / (m - m * t + t)`; numpy 2 (NEP 50) would keep it float64 and round only the
result. Two independent computations of those values: numpy with the float32 rounding of `m`
written out (so the test means the same on numpy 1 and 2), and plain Python floats rounded to
float32 after every operation (one IEEE operation on float32 operands done in float64 and rounded
once gives the correctly rounded float32 result: 53 >= 2 * 24 + 2 bits).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from reference_models.dit import sampler as ref_sampler
from serving_models.dit import sampler as srv_sampler

STEPS = [1, 2, 4, 6, 8, 16, 20, 28, 30, 50, 100, 250]
# Square, H < W and H > W latents, tiny and full resolutions (a 1024x1024 image is 128x128).
SIZES = [(32, 32), (32, 48), (48, 32), (64, 64), (64, 128), (128, 64), (128, 128), (96, 160), (160, 96)]
SCHEDULES = {"reference": ref_sampler.flow_match_timesteps, "serving": srv_sampler.flow_match_timesteps}


def release_numpy(steps: int, h: int, w: int) -> np.ndarray:
    grid = np.linspace(0, 1, steps + 1, dtype=np.float32)[:-1]
    m = np.float32(np.sqrt(h * w) / 40)  # numpy 1.26: the float64 scalar meets a float32 array
    shifted = grid / (m - m * grid + grid)
    assert shifted.dtype == np.float32
    return np.concatenate([shifted, np.ones(1, dtype=np.float32)])


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def release_python(steps: int, h: int, w: int) -> np.ndarray:
    m = f32(math.sqrt(h * w) / 40)
    out = []
    for i in range(steps):
        t = f32(i * (1.0 / steps))  # numpy's linspace: index times the float64 step, one rounding
        denominator = f32(f32(m - f32(m * t)) + t)
        out.append(f32(t / denominator))
    return np.array([*out, 1.0], dtype=np.float32)


def bits(values: torch.Tensor | np.ndarray) -> np.ndarray:
    array = values.numpy() if isinstance(values, torch.Tensor) else values
    assert array.dtype == np.float32
    return array.view(np.int32)


def differing(schedule, independent) -> list[tuple[int, int, int]]:
    """(steps, h, w) of every lattice point where `schedule` is not bit-equal to `independent`."""
    return [
        (steps, h, w)
        for steps in STEPS
        for h, w in SIZES
        if not np.array_equal(bits(schedule(steps, h, w)), bits(independent(steps, h, w)))
    ]


def test_the_two_independent_computations_agree():
    assert differing(release_numpy, release_python) == []


@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=SCHEDULES.keys())
@pytest.mark.parametrize("independent", [release_numpy, release_python], ids=["numpy", "python"])
def test_schedule_is_bit_equal_to_the_release(schedule, independent):
    assert differing(schedule, independent) == []
    assert schedule(4, 32, 48).dtype == torch.float32


def torch_linspace_schedule(steps: int, h: int, w: int) -> torch.Tensor:
    """The defect: the same formula on `torch.linspace`'s float32 grid."""
    t = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float32)[:-1]
    m = math.sqrt(h * w) / 40.0
    return torch.cat([t / (m - m * t + t), torch.ones(1)])


def numpy2_promotion_schedule(steps: int, h: int, w: int) -> np.ndarray:
    """The release's expression as numpy 2 evaluates it: the shift in float64, rounded at the end."""
    grid = np.linspace(0, 1, steps + 1, dtype=np.float32)[:-1].astype(np.float64)
    m = np.sqrt(h * w) / 40
    return np.concatenate([(grid / (m - m * grid + grid)).astype(np.float32), np.ones(1, dtype=np.float32)])


def square_only_shift_schedule(steps: int, h: int, w: int) -> torch.Tensor:
    """A port that derives the shift from the height alone: right for square latents only."""
    return ref_sampler.flow_match_timesteps(steps, h, h)


@pytest.mark.parametrize(
    "wrong",
    [torch_linspace_schedule, numpy2_promotion_schedule, square_only_shift_schedule],
    ids=["torch-linspace", "numpy2-promotion", "square-only-shift"],
)
def test_the_bit_comparison_catches_other_float32_schedules(wrong):
    """Each wrong schedule is caught (measured: torch.linspace misses at 58 of the 108 lattice
    points, by 1 to 4 ULP; numpy 2 promotion at 82; the square-only shift at exactly the non-square
    points with more than one step, where t_1 onwards depend on the shift)."""
    misses = differing(wrong, release_numpy)
    assert misses
    if wrong is square_only_shift_schedule:
        assert misses == [(steps, h, w) for steps in STEPS if steps > 1 for h, w in SIZES if h != w]


def test_non_square_schedules_differ_from_square_ones():
    """H != W moves the shift (sqrt(h*w)): a schedule check on square latents only would not see a
    port that uses one side; both orientations give the same schedule (the shift is symmetric)."""
    assert torch.equal(ref_sampler.flow_match_timesteps(50, 64, 128), ref_sampler.flow_match_timesteps(50, 128, 64))
    assert not torch.equal(ref_sampler.flow_match_timesteps(50, 64, 128), ref_sampler.flow_match_timesteps(50, 64, 64))

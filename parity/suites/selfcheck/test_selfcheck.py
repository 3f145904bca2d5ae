"""Harness self-checks: the metrics every suite relies on, against answers known in closed form.

These run first in every `parity run` (and are the only suite when no model suite is selected):
a PSNR with an inferred data range, a cosine or ULP distance computed wrongly, or an eager run
that is not deterministic would make every later verdict meaningless.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Literal

import numpy as np
import pytest
import torch

from parity.cases import Positive, Range, Seed, Table, load_case_file
from parity.compare import AT_MOST, EXACTLY, Tolerance, count_rule, diff, threshold_rule, ulp_distance
from parity.compare.images import psnr

pytestmark = pytest.mark.parity_suite("selfcheck")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class PsnrCase:
    name: str
    data_range: Annotated[float, Range(1e-6, None)]  # PSNR divides by it
    offset: float
    size: Annotated[int, Range(1, 4096)]


@dataclasses.dataclass(frozen=True)
class CosineCase:
    name: str
    a: Annotated[list[float], Range(1, None)]
    b: Annotated[list[float], Range(1, None)]
    expected: Annotated[float, Range(-1.0, 1.0)]


@dataclasses.dataclass(frozen=True)
class UlpCase:
    name: str
    dtype: Literal["fp32", "bf16", "fp16"]
    value: float
    steps: Annotated[int, Range(0, 1 << 20)]


@dataclasses.dataclass(frozen=True)
class DeterminismCase:
    name: str
    rows: Positive
    cols: Positive
    seed: Seed


CASES = load_case_file(
    "selfcheck.toml",
    {
        "tolerances": Table(Tolerance, keyed=True),
        "psnr": Table(PsnrCase),
        "cosine": Table(CosineCase),
        "ulp": Table(UlpCase),
        "determinism": Table(DeterminismCase),
    },
)
TOL = CASES["tolerances"]["closed_form"]


def _ids(cases):
    return [c.name for c in cases]


def _bound(expected: float) -> float:
    """The closed-form tolerance at `expected`: allclose's `atol + rtol * |expected|`."""
    return TOL.atol + TOL.rtol * abs(expected)


@pytest.mark.parametrize("case", CASES["psnr"], ids=_ids(CASES["psnr"]))
def test_psnr_closed_form(case: PsnrCase, report) -> None:
    rng = np.random.default_rng(0)
    if case.data_range == 255.0:
        ref = rng.integers(10, 240, size=(case.size, case.size, 3), dtype=np.uint8)
        cand = ref + np.uint8(case.offset)
    else:
        ref = rng.uniform(0.2, 0.8, size=(case.size, case.size, 3))
        cand = ref + case.offset
    expected = 10 * math.log10(case.data_range**2 / case.offset**2)
    score = psnr(ref, cand, data_range=case.data_range)
    error = abs(score.value - expected)
    report.verdict(
        threshold_rule(
            error,
            _bound(expected),
            metric="psnr_error_db",
            at=AT_MOST,
            detail=f"psnr={score.value:.6f} expected={expected:.6f} data_range={score.data_range:g} ({TOL.reason})",
        ),
        case=case.name,
    )


@pytest.mark.parametrize("case", CASES["cosine"], ids=_ids(CASES["cosine"]))
def test_cosine_closed_form(case: CosineCase, report) -> None:
    measured = diff(torch.tensor(case.a, dtype=torch.float64), torch.tensor(case.b, dtype=torch.float64), name=case.name)
    error = abs(measured.cosine - case.expected)
    report.verdict(
        # |cosine| <= 1, so rtol * |expected| never exceeds atol here: the bound is atol
        threshold_rule(
            error,
            TOL.atol,
            metric="cosine_error",
            at=AT_MOST,
            detail=f"cosine={measured.cosine!r} expected={case.expected} ({TOL.reason})",
        ),
        case=case.name,
    )


@pytest.mark.parametrize("case", CASES["ulp"], ids=_ids(CASES["ulp"]))
def test_ulp_distance_of_neighbours(case: UlpCase, report) -> None:
    dtype = DTYPES[case.dtype]
    start = torch.tensor([case.value], dtype=dtype)
    neighbour = start.clone()
    for _ in range(case.steps):
        neighbour = torch.nextafter(neighbour, torch.tensor([math.inf], dtype=dtype))
    distance = int(ulp_distance(start, neighbour)[0])
    report.verdict(
        count_rule(
            distance,
            case.steps,
            metric="ulp_distance",
            at=EXACTLY,
            detail=f"{case.value!r} to its {case.steps}-th next {case.dtype} neighbour {float(neighbour[0])!r}",
        ),
        case=case.name,
    )


@pytest.mark.parametrize("case", CASES["determinism"], ids=_ids(CASES["determinism"]))
def test_eager_is_deterministic(case: DeterminismCase, report, device) -> None:
    generator = torch.Generator().manual_seed(case.seed)
    a = torch.randn(case.rows, case.cols, generator=generator).to(device)
    b = torch.randn(case.cols, case.rows, generator=generator).to(device)
    first, second = torch.softmax(a @ b, -1), torch.softmax(a @ b, -1)
    exact = Tolerance(0.0, 0.0, "the same op on the same inputs twice must be bitwise equal")
    report.diff(diff(first, second, exact, name="softmax(a@b)"), case=case.name, seed=case.seed)

"""Rules that turn measurements into verdicts.

* `allclose_rule`: plain `|cand - ref| <= atol + rtol * |ref|` element-wise.
* `noise_floor_rule`: the candidate's RMSE against an fp64 golden may be at most `multiplier`
  times the eager reference's RMSE against the same golden, plus a floor (`atol / 10`): the rule of
  `torch._dynamo.utils.same`. Its bound is *measured* (`Verdict.bound`), not a policy.
* `classify_decision`: a differing top-1 (or k-th) decision is a `tie_flip` when its margin is
  inside the compared dtype's spacing at that magnitude, else a `fail`.

docs/tolerances.md derives each rule and says where it applies.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from parity.compare.diff import diff
from parity.compare.verdict import FAIL, MEASURED, PASS, TIE_FLIP, Tolerance, Verdict


def allclose_rule(ref: torch.Tensor, cand: torch.Tensor, tol: Tolerance, *, name: str = "output") -> Verdict:
    """Plain atol/rtol: every element within `atol + rtol * |ref|`, non-finite values matching."""
    return diff(ref, cand, tol, name=name).verdict("max_abs")


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """Root-mean-square error in fp64 over finite pairs; inf when a pair is non-finite."""
    a64, b64 = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    if not (torch.isfinite(a64).all() and torch.isfinite(b64).all()):
        return math.inf
    return float(((a64 - b64) ** 2).mean().sqrt()) if a64.numel() else 0.0


def noise_floor_multiplier(dtype: torch.dtype, numel: int) -> float:
    """The multiplier of `torch._dynamo.utils.same`: 2 for fp32, 3 for fp16/bf16 and small tensors.

    Source comment there: AMP-vs-fp32 end-to-end accuracy differs by < 0.1%, so 3 avoids false
    alarms in half precision; tensors under 1000 elements get 3 as well (their RMSE is noisier).
    """
    if dtype in (torch.float16, torch.bfloat16) or numel < 1000:
        return 3.0
    return 2.0


@dataclasses.dataclass(frozen=True)
class NoiseFloor:
    """The numbers the noise-floor rule was decided on, for the report."""

    ref_error: float  # RMSE(golden, eager reference in the candidate's dtype)
    res_error: float  # RMSE(golden, candidate)
    multiplier: float
    floor: float
    threshold: float  # multiplier * ref_error + floor
    ratio: float  # res_error / ref_error
    allclose: bool  # passed the plain atol/rtol pre-check


def noise_floor_rule(
    golden: torch.Tensor,
    eager: torch.Tensor,
    cand: torch.Tensor,
    tol: Tolerance,
    *,
    multiplier: float | None = None,
    name: str = "output",
) -> tuple[Verdict, NoiseFloor]:
    """Judge `cand` by how far it is from an fp64 `golden`, relative to the eager reference's error.

    Pass if `cand` is allclose to `eager`, or if `RMSE(golden, cand) <= multiplier *
    RMSE(golden, eager) + atol / 10`. The candidate may be as noisy as the dtype makes the eager
    reference, not noisier. Non-finite candidates fail with "non-finite" in the detail.
    """
    if multiplier is None:
        multiplier = noise_floor_multiplier(cand.dtype, cand.numel())
    floor = tol.atol / 10.0
    close = diff(eager, cand, tol, name=name).ok
    ref_error = rmse(golden, eager)
    res_error = rmse(golden, cand)
    threshold = multiplier * ref_error + floor
    ratio = res_error / ref_error if ref_error > 0 else (0.0 if res_error == 0 else math.inf)
    record = NoiseFloor(ref_error, res_error, multiplier, floor, threshold, ratio, close)
    summary = (
        f"{name}: rmse(golden,cand)={res_error:.3g} rmse(golden,eager)={ref_error:.3g} "
        f"ratio={ratio:.3g} threshold={multiplier:g}*{ref_error:.3g}+{floor:.3g}"
    )
    cand_nonfinite = int((~torch.isfinite(cand.detach().float())).sum())
    # The threshold is measured (the eager reference's error in this run, on this machine's kernels).
    if cand_nonfinite:
        return Verdict(FAIL, "rmse_vs_golden", res_error, threshold, f"non-finite: {cand_nonfinite} values; {summary}", MEASURED), record
    if close or res_error <= threshold:
        how = "allclose to eager" if close else "within noise floor"
        return Verdict(PASS, "rmse_vs_golden", res_error, threshold, f"{how}; {summary}", MEASURED), record
    return Verdict(FAIL, "rmse_vs_golden", res_error, threshold, f"above noise floor; {summary}", MEASURED), record


def dtype_spacing(value: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """Distance from |value| to the next representable number of `dtype` (one ULP at that magnitude)."""
    v = torch.as_tensor(value, dtype=torch.float64).abs().to(dtype)
    up = torch.nextafter(v, torch.full_like(v, math.inf))
    return (up.to(torch.float64) - v.to(torch.float64)).abs()


def classify_decision(margin: float, magnitude: float, dtype: torch.dtype, spacings: float = 2.0) -> str:
    """`tie_flip` when a differing top-1 (or k-th vs k+1-th) decision's margin is inside the noise.

    The margin is compared with `spacings` ULPs of `dtype` at the decision's magnitude (practice.md
    section 2: spacing scales with magnitude, so a fixed gap misfires on large logits).
    """
    noise = spacings * float(dtype_spacing(magnitude, dtype))
    return TIE_FLIP if margin <= noise else FAIL

"""Rules that turn measurements into verdicts.

* `allclose_rule`: plain `|cand - ref| <= atol + rtol * |ref|` element-wise.
* `noise_floor_rule`: the candidate's RMSE against an fp64 golden may be at most `multiplier`
  times the eager reference's RMSE against the same golden, plus a floor (`atol / 10`), after a
  plain atol/rtol pre-check: the rule of `torch._dynamo.utils.same`. Its bound is *measured*
  (`Verdict.bound`), not a policy; the pre-check and the floor are policies of the caller's tolerance.
* `golden_noise_rule`: the same comparison with nothing fixed in it: no pre-check, and the floor
  is the golden's own rounding to the candidate's dtype (the error no implementation in that
  dtype can go under), so the whole bound comes from the run's numbers.
* `classify_decision`: a differing top-1 (or k-th) decision is a `tie_flip` when its margin is
  inside the compared dtype's spacing at that magnitude, else a `fail`.

Rules for numbers that are not tensors (every suite writes its verdicts through one of them, so a
row's value, threshold and verdict always agree):

* `count_rule`: a count held to a policy: at most, at least or exactly N (mismatched tokens at
  most 0, new compiles exactly the expected number, modules compiled at least 1).
* `threshold_rule`: a measured number (a PSNR, an error, a distance) at most or at least a bound,
  fixed or measured; NaN never passes.
* `flag_rule`: a yes/no property (an attribute present, a capture refused), recorded as 1 or 0
  against 1.
* `equality_rule`: two values that must be equal (the layers a config enables), recorded as 1 or
  0 against 1 with both values in the detail.

Each rule's `Verdict` carries its direction (`Verdict.better`: at most `lower`, at least `higher`,
exactly / a flag / an equality `equal`; the tensor rules judge errors: `lower`), and the row writer
takes it from there. docs/tolerances.md derives each rule and says where it applies.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Final, Literal

import torch

from parity.compare.diff import diff
from parity.compare.metrics import DIRECTIONS, EQUAL, HIGHER, LOWER
from parity.compare.verdict import (
    BOUND_KINDS,
    FAIL,
    FIXED,
    MEASURED,
    PASS,
    TIE_FLIP,
    Tolerance,
    Verdict,
    with_rule,
)


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
    floor: float  # atol / 10 (noise_floor_rule) or the golden's rounding to the candidate's dtype (golden_noise_rule)
    threshold: float  # multiplier * ref_error + floor
    ratio: float  # res_error / ref_error
    allclose: bool  # passed the plain atol/rtol pre-check (golden_noise_rule has none: False)


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
        return Verdict(
            FAIL, "rmse_vs_golden", res_error, threshold, f"non-finite: {cand_nonfinite} values; {summary}", MEASURED
        ), record
    if close or res_error <= threshold:
        how = "allclose to eager" if close else "within noise floor"
        return Verdict(PASS, "rmse_vs_golden", res_error, threshold, f"{how}; {summary}", MEASURED), record
    return Verdict(FAIL, "rmse_vs_golden", res_error, threshold, f"above noise floor; {summary}", MEASURED), record


def rounding_floor(golden: torch.Tensor, dtype: torch.dtype) -> float:
    """RMSE between the fp64 `golden` and its rounding to `dtype`: the error of merely storing the
    exact answer in that dtype, which no implementation computing in it can go under."""
    g = golden.detach().to("cpu", torch.float64)
    return rmse(g, g.to(dtype))


def golden_noise_rule(
    golden: torch.Tensor,
    eager: torch.Tensor,
    cand: torch.Tensor,
    *,
    multiplier: float | None = None,
    name: str = "output",
    reason: str = "",
) -> tuple[Verdict, NoiseFloor]:
    """Judge `cand` by its RMSE against the fp64 `golden`, relative to the eager reference's:
    pass if `RMSE(golden, cand) <= multiplier * RMSE(golden, eager) + RMSE(golden, golden in
    cand's dtype)`.

    Every term is measured in this run: the reference's own error in the candidate's dtype on
    this machine's kernels, and the dtype's rounding of the golden (a floor for outputs the
    reference computes exactly). Unlike `noise_floor_rule` there is no plain atol/rtol pre-check
    and no fixed floor, so the bound scales with the outputs: on logits of |x| ~ 0.5 a bf16
    pre-check at 1e-2 passes a defect of several spacings, and a 1e-3 floor is as large as the
    noise it sits on. The multiplier is `torch._dynamo.utils.same`'s (`noise_floor_multiplier`).
    """
    if multiplier is None:
        multiplier = noise_floor_multiplier(cand.dtype, cand.numel())
    floor = rounding_floor(golden, cand.dtype)
    ref_error = rmse(golden, eager)
    res_error = rmse(golden, cand)
    threshold = multiplier * ref_error + floor
    ratio = res_error / ref_error if ref_error > 0 else (0.0 if res_error == 0 else math.inf)
    record = NoiseFloor(ref_error, res_error, multiplier, floor, threshold, ratio, False)
    summary = (
        f"{name}: rmse(golden,cand)={res_error:.3g} rmse(golden,eager)={ref_error:.3g} "
        f"ratio={ratio:.3g} threshold={multiplier:g}*{ref_error:.3g}+{floor:.3g} (rounding of the golden to {cand.dtype})"
    )
    summary = with_rule(summary, reason)
    cand_nonfinite = int((~torch.isfinite(cand.detach().float())).sum())
    if cand_nonfinite:
        return Verdict(
            FAIL, "rmse_vs_golden", res_error, threshold, f"non-finite: {cand_nonfinite} values; {summary}", MEASURED, rule=reason
        ), record
    if res_error <= threshold:
        return Verdict(
            PASS, "rmse_vs_golden", res_error, threshold, f"within noise floor; {summary}", MEASURED, rule=reason
        ), record
    return Verdict(FAIL, "rmse_vs_golden", res_error, threshold, f"above noise floor; {summary}", MEASURED, rule=reason), record


def dtype_spacing(value: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """Distance from |value| to the next representable number of `dtype` (one ULP at that magnitude)."""
    v = torch.as_tensor(value, dtype=torch.float64).abs().to(dtype)
    up = torch.nextafter(v, torch.full_like(v, math.inf))
    return (up.to(torch.float64) - v.to(torch.float64)).abs()


def classify_decision(
    margin: float, magnitude: float, dtype: torch.dtype, spacings: float = 2.0, measured_noise: float = 0.0
) -> str:
    """`tie_flip` when a differing top-1 (or k-th vs k+1-th) decision's margin is inside the noise.

    The noise is the larger of `spacings` ULPs of `dtype` at the decision's magnitude (docs/tolerances.md §3:
    spacing scales with magnitude, so a fixed gap misfires on large logits) and `measured_noise`,
    a deviation measured in the same run (the decode suite passes the two implementations' largest
    distance from the fp64 golden at that step: logits that far from the exact values can swap any
    two whose margin is smaller).
    """
    noise = max(spacings * float(dtype_spacing(magnitude, dtype)), measured_noise)
    return TIE_FLIP if margin <= noise else FAIL


# ---------------------------------------------------------------------------------------------
# Rules for scalar checks: counts, thresholds, yes/no properties, equalities
# ---------------------------------------------------------------------------------------------

AT_MOST: Final = "at_most"
AT_LEAST: Final = "at_least"
EXACTLY: Final = "exactly"
Direction = Literal["at_most", "at_least", "exactly"]
# The report's `better` column for each direction (how a baseline comparison reads the value):
# the `Verdict.better` of a count_rule / threshold_rule.
BETTER = {AT_MOST: LOWER, AT_LEAST: HIGHER, EXACTLY: EQUAL}
_WORDS = {AT_MOST: "at most", AT_LEAST: "at least", EXACTLY: "exactly"}


def _holds(value: float, threshold: float, at: str) -> bool:
    if at == AT_MOST:
        return value <= threshold
    if at == AT_LEAST:
        return value >= threshold
    if at == EXACTLY:
        return value == threshold
    raise ValueError(f"at must be one of {AT_MOST!r}, {AT_LEAST!r}, {EXACTLY!r}, got {at!r}")


def count_rule(value: int, threshold: int, *, metric: str, at: Direction = AT_MOST, detail: str = "") -> Verdict:
    """A count held to a policy: `value` at most, at least or exactly `threshold`.

    Counts are integers (a bool is refused: use `flag_rule`), so the verdict needs no tolerance.
    Its direction follows `at` (`BETTER`): at most is better lower, at least higher, exactly equal.
    """
    for name, number in (("value", value), ("threshold", threshold)):
        if isinstance(number, bool) or not isinstance(number, numbers.Integral):
            raise TypeError(f"count_rule({metric}): {name} must be an int count, got {type(number).__name__} {number!r}")
    verdict = PASS if _holds(value, threshold, at) else FAIL
    return Verdict(verdict, metric, int(value), int(threshold), detail, FIXED, BETTER[at])


def threshold_rule(
    value: float,
    threshold: float,
    *,
    metric: str,
    at: Literal["at_most", "at_least"] = AT_MOST,
    detail: str = "",
    bound: str = FIXED,
) -> Verdict:
    """A measured number against a bound, inclusive: `value <= threshold` (`at_most`) or `>=`.

    `bound` says how the threshold was set (`fixed` policy or `measured` in this run). A NaN value
    or threshold never passes (its detail says "non-finite"); +inf passes `at_least` (identical
    images have PSNR inf) and fails `at_most`. Its direction follows `at`: at most lower, at least higher.
    """
    if at == EXACTLY:
        raise ValueError(f"threshold_rule({metric}): 'exactly' is for counts (count_rule); a float needs a tolerance")
    if bound not in BOUND_KINDS[:2]:
        raise ValueError(f"threshold_rule({metric}): bound must be {FIXED!r} or {MEASURED!r}, got {bound!r}")
    value, threshold = float(value), float(threshold)
    if math.isnan(value) or math.isnan(threshold):
        text = f"non-finite: {metric}={value} against {_WORDS[at]} {threshold}"
        return Verdict(FAIL, metric, value, threshold, f"{text}; {detail}" if detail else text, bound, BETTER[at])
    verdict = PASS if _holds(value, threshold, at) else FAIL
    return Verdict(verdict, metric, value, threshold, detail, bound, BETTER[at])


def flag_rule(
    ok: bool,
    *,
    metric: str,
    detail: str = "",
    value: float | None = None,
    threshold: float = 1,
    better: str | None = None,
) -> Verdict:
    """A yes/no property (an attribute present, a capture refused, a phrase in a message).

    The row holds 1 / 0 against 1 unless `value` names the number the property was read from
    (e.g. the gen expert's call count when the property is "both experts ran").

    Direction: 1 / 0 against 1 is `equal` (the answer must be yes). A `value` is a count read
    beside the flag, by default of things that should not happen (`lower`: eager fallbacks, false
    alarms); pass `better` when more of it is better (the gen expert's calls: `higher`).
    """
    if isinstance(ok, (numbers.Number, str)) and not isinstance(ok, bool):
        # a count or a message is not a yes/no answer: count_rule / threshold_rule say what they hold
        raise TypeError(f"flag_rule({metric}): ok must be a bool, got {type(ok).__name__} {ok!r}")
    ok = bool(ok)
    if better is None:
        better = EQUAL if value is None else LOWER
    elif better not in DIRECTIONS:
        raise ValueError(f"flag_rule({metric}): better must be one of {DIRECTIONS}, got {better!r}")
    return Verdict(PASS if ok else FAIL, metric, int(ok) if value is None else value, threshold, detail, FIXED, better)


def equality_rule(got: Any, expected: Any, *, metric: str, detail: str = "") -> Verdict:
    """Two values that must be equal (lists, ids, names): 1 / 0 against 1, both values in the
    detail; its direction is `equal`."""
    equal = bool(got == expected)
    text = f"got {got!r}, expected {expected!r}"
    return Verdict(PASS if equal else FAIL, metric, int(equal), 1, f"{detail}: {text}" if detail else text, FIXED, EQUAL)

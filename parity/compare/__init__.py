"""Tensor comparison: the numbers a reviewer needs to judge a difference, and the rules that judge it.

`diff(ref, cand, tol)` measures two tensors (max / mean abs, relative L2, cosine, ULP distance in
the candidate's dtype, argmax / top-k agreement over the last dim, the first element and row over
tolerance, non-finite counts). `compare(ref, cand, tol)` walks nested outputs (dicts, tuples,
per-layer lists, dataclasses) and returns one `TensorDiff` per leaf, in order, so the first
diverging layer is the first failing leaf. Two rules turn a diff into a `Verdict`:

* `allclose_rule`: plain `|cand - ref| <= atol + rtol * |ref|` element-wise.
* `noise_floor_rule`: the candidate's RMSE against an fp64 golden may be at most `multiplier`
  times the eager reference's RMSE against the same golden, plus a floor (`tol / 10`): the rule of
  `torch._dynamo.utils.same`. Its bound is *measured* (`Verdict.bound`), not a policy.
* `golden_noise_rule`: the same without a pre-check and with the golden's rounding to the
  candidate's dtype as the floor: every term of its bound is measured in the run.

Scalar checks go through `count_rule`, `threshold_rule`, `flag_rule` and `equality_rule`, so
every suite row's value, threshold, verdict and direction (`Verdict.better`) come from one place.

Non-finite values never raise: they give a `fail` verdict whose detail says "non-finite".
"""

from parity.compare.diff import TensorDiff, TreeDiff, compare, diff, flatten, ulp_distance
from parity.compare.metrics import DIRECTIONS, EQUAL, HIGHER, LOWER
from parity.compare.rules import (
    AT_LEAST,
    AT_MOST,
    BETTER,
    EXACTLY,
    NoiseFloor,
    allclose_rule,
    classify_decision,
    count_rule,
    dtype_spacing,
    equality_rule,
    flag_rule,
    golden_noise_rule,
    noise_floor_multiplier,
    noise_floor_rule,
    rmse,
    rounding_floor,
    threshold_rule,
)
from parity.compare.verdict import (
    BOUND_KINDS,
    DIFF_METRIC_BETTER,
    ERROR,
    EXACT,
    FAIL,
    FIXED,
    MEASURED,
    NOT_APPLICABLE,
    PASS,
    SKIP,
    TIE_FLIP,
    VERDICTS,
    Tolerance,
    Verdict,
    better_of,
    with_rule,
)

__all__ = [
    "AT_LEAST",
    "AT_MOST",
    "BETTER",
    "EXACTLY",
    "count_rule",
    "equality_rule",
    "flag_rule",
    "golden_noise_rule",
    "rounding_floor",
    "threshold_rule",
    "BOUND_KINDS",
    "DIFF_METRIC_BETTER",
    "DIRECTIONS",
    "EQUAL",
    "HIGHER",
    "LOWER",
    "better_of",
    "with_rule",
    "ERROR",
    "EXACT",
    "FAIL",
    "FIXED",
    "MEASURED",
    "NOT_APPLICABLE",
    "SKIP",
    "PASS",
    "TIE_FLIP",
    "VERDICTS",
    "NoiseFloor",
    "TensorDiff",
    "Tolerance",
    "TreeDiff",
    "Verdict",
    "allclose_rule",
    "classify_decision",
    "compare",
    "diff",
    "dtype_spacing",
    "flatten",
    "noise_floor_multiplier",
    "noise_floor_rule",
    "rmse",
    "ulp_distance",
]

"""Verdicts and tolerances: what a check decided, on which number, against which bound and why.

A `Tolerance` is an atol/rtol pair with its stated reason; a `Verdict` carries the verdict, the
metric and value it was decided on, the bound it met, how that bound was set (`fixed` policy
or `measured` in the same run) and which way the value is better (`lower`, `higher`, `equal`:
the rule that made it knows). Report rows are written from verdicts (`parity.report`).
"""

from __future__ import annotations

import dataclasses
import math

from parity.compare.metrics import DIRECTIONS, LOWER, METRICS, metric

# Verdict values of a report row (docs/reports.md §4). `not_applicable`: the check cannot apply to
# this target or lane (the reason is in the detail); it is neither a pass nor a failure. `skip`: the
# test did not run at all (pytest skipped it: another lane's mode, a family the target does not
# provide); the plugin writes one info row per skipped test with pytest's reason, so a run accounts
# for every test it collected.
PASS, FAIL, TIE_FLIP, ERROR, NOT_APPLICABLE, SKIP = "pass", "fail", "tie_flip", "error", "not_applicable", "skip"
VERDICTS = (PASS, FAIL, TIE_FLIP, ERROR, NOT_APPLICABLE, SKIP)
# How a row's bound was set (the report's `bound` column): FIXED is a policy (a case-file tolerance,
# an expected count) that only changes when someone changes it; MEASURED is derived from noise
# measured in the same run (the noise-floor rule's multiplier x RMSE(golden, eager) + floor), so it
# moves with the machine's kernels. A baseline comparison treats the two differently
# (parity.report.baseline, docs/machine-independence.md).
FIXED, MEASURED = "fixed", "measured"
BOUND_KINDS = (FIXED, MEASURED, "")
# Which way a row's value is better (the report's `better` column, read by a baseline comparison):
# an error or a count of defects is better lower, a PSNR or a count of things that must happen
# higher, a count held to an exact number equal. A rule sets it on its `Verdict` (parity.compare.rules:
# an at-most bound is LOWER, at-least HIGHER, exactly / a flag / an equality EQUAL), so the row
# writer never has to be told beside the rule. The directions, and each metric's own, live in the
# metrics table (parity.compare.metrics).
# The info metrics of a diff (parity.compare.diff.TensorDiff): an info row has no rule to carry a
# direction, so the writers of a diff's numbers read the table's (`better_of`).
DIFF_METRICS = (
    "max_abs",
    "mean_abs",
    "rel_l2",
    "max_ulp",
    "n_bad",
    "nonfinite_ref",
    "nonfinite_cand",
    "nonfinite_mismatch",
    "cosine",
    "argmax_agree",
    "topk_agree",
)
DIFF_METRIC_BETTER = {name: METRICS[name].better for name in DIFF_METRICS}


def better_of(name: str) -> str:
    """The direction the metrics table gives `name` (parity.compare.metrics); KeyError for a metric
    it does not know."""
    return metric(name).better


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """An atol / rtol pair and the reason it is what it is (every bound states its reason)."""

    atol: float
    rtol: float
    reason: str

    def __post_init__(self) -> None:
        # `not 0 <= x < inf` also refuses NaN: `err > nan` is False, so a NaN bound would pass everything.
        if not (0 <= self.atol < math.inf and 0 <= self.rtol < math.inf):
            raise ValueError(f"tolerance must be finite and non-negative, got atol={self.atol} rtol={self.rtol}")
        if not self.reason.strip():
            raise ValueError("a tolerance needs a stated reason")

    def describe(self) -> str:
        return f"atol={self.atol:g} rtol={self.rtol:g} ({self.reason})"


def with_rule(detail: str, rule: str) -> str:
    """`detail` followed by a tolerance rule's reason in brackets (a `Verdict`'s `rule`)."""
    return f"{detail} [{rule}]" if rule else detail


EXACT = Tolerance(0.0, 0.0, "bitwise: both sides run the same ops on the same shapes")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of one check, carrying the number it was decided on and the bound it met."""

    verdict: str
    metric: str
    value: float
    threshold: float | None
    detail: str = ""
    bound: str | None = None  # FIXED or MEASURED; None: FIXED when there is a threshold, else ''
    better: str = LOWER  # the direction of `value` (a rule sets it; an error, the default, is better lower)
    # The stated reason of the tolerance rule that judged it, when the detail ends with it in brackets
    # (`with_rule`): written as the row's data, so a reader never parses it back out of the detail.
    rule: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.bound is None:
            object.__setattr__(self, "bound", FIXED if self.threshold is not None else "")
        if self.bound not in BOUND_KINDS:
            raise ValueError(f"bound must be one of {BOUND_KINDS}, got {self.bound!r}")
        if self.better not in DIRECTIONS:
            raise ValueError(f"better must be one of {DIRECTIONS}, got {self.better!r}")
        if self.rule and not self.detail.endswith(f" [{self.rule}]"):
            raise ValueError(f"a verdict's rule ends its detail in brackets (with_rule): {self.detail[-80:]!r}")

    @property
    def ok(self) -> bool:
        """A tie flip is not a defect (the decision was inside the dtype's noise); a check that
        does not apply (or did not run) is not one either."""
        return self.verdict in (PASS, TIE_FLIP, NOT_APPLICABLE, SKIP)

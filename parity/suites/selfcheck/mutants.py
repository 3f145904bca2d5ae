"""Report and review mutants of the sensitivity catalogue: the harness's own verdict-making, broken.

A parity harness fails its users the way a port does: a review that reads a PSNR drop as an
improvement, or passes a run whose checks stopped running, turns every red suite green again
(vllm-project/vllm-omni#7455: a compile-parity suite that passed on eager code). Each entry
patches one named function or constant of `parity.report` in the process that loads it and
returns the built-in target; the self-check suite's review cases
(`parity/suites/selfcheck/test_review.py`: a review run on crafted results files) must kill it.
`--target parity.suites.selfcheck.mutants:mutant_<name with _ for ->`.
"""

from __future__ import annotations

import importlib
import math

from parity.suites.sensitivity.catalogue import factory_lookup, mutant

__getattr__ = factory_lookup(__name__)

REVIEW_TESTS = ("parity/suites/selfcheck/test_review.py",)


def _comparison():
    return importlib.import_module("parity.report.comparison")


def _replace(owner: object, name: str, value: object) -> None:
    """Set `owner.name`, which must exist: a mutant whose function moved must fail loudly, not
    plant its defect on a name nothing reads (and survive as if the suites had missed it)."""
    if not hasattr(owner, name):
        raise AttributeError(f"{getattr(owner, '__name__', owner)!s} has no {name}: the mutant's patch names nothing")
    setattr(owner, name, value)


@mutant(
    "review-direction-blind-share",
    defect=(
        "the review computes a row's share of its bound as value / threshold whatever the direction: a PSNR "
        "that dropped toward its floor reads as using less of the bound (an improvement)"
    ),
    suite="selfcheck",
    tests=REVIEW_TESTS,
)
def _direction_blind() -> None:
    def allowance_used(value: float, threshold: float, better: str) -> float:
        if threshold == 0 or math.isnan(threshold) or math.isnan(value):
            return math.nan
        return value / threshold

    _replace(_comparison(), "allowance_used", allowance_used)


@mutant(
    "review-measured-bounds-unchecked",
    defect=(
        "the review never reads a measured bound as loosened (measured bounds taken for pure noise): a multiplier "
        "or floor changed for every row of a rule passes review"
    ),
    suite="selfcheck",
    tests=REVIEW_TESTS,
)
def _measured_unchecked() -> None:
    comparison = _comparison()
    _replace(comparison, "MEASURED_BOUND_FACTOR", math.inf)
    _replace(comparison, "MEASURED_GROUP_FACTOR", math.inf)


@mutant(
    "review-vanished-gate-rows-pass",
    defect=(
        "the review lists vanished gate rows but passes the run: a check that stopped running (a suite deselected, "
        "a test that skips everything) is not a failure"
    ),
    suite="selfcheck",
    tests=REVIEW_TESTS,
)
def _vanished_pass() -> None:
    _replace(_comparison().Comparison, "vanished_gate_rows", property(lambda self: 0))

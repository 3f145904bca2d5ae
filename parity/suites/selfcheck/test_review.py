"""Self-check of the review: a baseline comparison run on crafted results files whose answer is known.

`parity review` turns a run into a verdict against a baseline. If it read a PSNR drop as an
improvement, let measured bounds grow unchecked or passed a run whose gate rows vanished, every
suite could go red and the review would still say OK. Each case writes a baseline and a run as
`results.csv` files (`write_run`), reviews the run with `parity.report.review.load_review` as
`parity review RUN --baseline BASELINE` does, and holds the outcome to the known answer: a
defect case must be found (regressions plus vanished gate rows at least 1), a control case (the
same rows, or kernel noise within the rule's factors) must not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from parity.compare import AT_LEAST, AT_MOST, FIXED, MEASURED, count_rule
from parity.report.review import load_review
from parity.report.schema import COLUMNS, RESULTS_FILE

pytestmark = pytest.mark.parity_suite("selfcheck")

ROW = {
    "run_id": "crafted",
    "suite": "numerics",
    "target": "serving",
    "mode": "eager",
    "site": "",
    "device": "cpu",
    "dtype": "fp32",
    "size": "tiny",
    "detail": "",
    "seed": 0,
    "torch_version": "crafted",
    "git_sha": "",
    "kind": "gate",
    "better": "lower",
    "verdict": "pass",
    "test": "",
    "worker": "",
    "time": "",
}


def rows(*specs: dict[str, Any]) -> pd.DataFrame:
    return pd.DataFrame([{**ROW, **spec} for spec in specs], columns=list(COLUMNS))


def measured_rows(scale: Callable[[int], float], n: int = 20) -> pd.DataFrame:
    """`n` gate rows under a measured bound (a noise-floor rule's), bound i scaled by `scale(i)`."""
    return rows(
        *(
            {"case": f"case-{i}", "metric": "rmse_vs_golden", "value": 1e-8, "threshold": 3e-8 * scale(i), "bound": MEASURED}
            for i in range(n)
        )
    )


@dataclasses.dataclass(frozen=True)
class ReviewCase:
    name: str
    baseline: pd.DataFrame
    run: pd.DataFrame
    defect: bool  # True: the review must find it; False: a control the review must pass
    why: str


# Kernel noise: each measured bound moves its own way by up to x1.25 (one kernel set's rounding
# against another's), the geometric mean stays at 1 (docs/machine-independence.md).
NOISE = [1.25, 0.8, 1.1, 1 / 1.1, 1.2, 1 / 1.2, 1.05, 1 / 1.05, 1.15, 1 / 1.15]

CASES = [
    ReviewCase(
        "review-identical-run",
        rows({"case": "c", "metric": "max_abs", "value": 1e-6, "threshold": 1e-5, "bound": FIXED}),
        rows({"case": "c", "metric": "max_abs", "value": 1e-6, "threshold": 1e-5, "bound": FIXED}),
        defect=False,
        why="the same rows: nothing to report",
    ),
    ReviewCase(
        "review-measured-bounds-kernel-noise",
        measured_rows(lambda i: 1.0),
        measured_rows(lambda i: NOISE[i % len(NOISE)]),
        defect=False,
        why="measured bounds that moved row by row within x1.25, geometric mean 1: another machine's kernels",
    ),
    ReviewCase(
        "review-verdict-pass-to-fail",
        rows({"case": "c", "metric": "max_abs", "value": 1e-6, "threshold": 1e-5, "bound": FIXED}),
        rows({"case": "c", "metric": "max_abs", "value": 2e-5, "threshold": 1e-5, "bound": FIXED, "verdict": "fail"}),
        defect=True,
        why="a gate row that passed and fails now",
    ),
    ReviewCase(
        "review-psnr-drop-still-passing",
        rows({"case": "c", "metric": "psnr", "better": "higher", "value": 60.0, "threshold": 40.0, "bound": FIXED}),
        rows({"case": "c", "metric": "psnr", "better": "higher", "value": 45.0, "threshold": 40.0, "bound": FIXED}),
        defect=True,
        why="a higher-is-better row that went from 2/3 to 8/9 of its allowance (PSNR 60 -> 45 dB against 40): worse, though passing",
    ),
    ReviewCase(
        "review-measured-bounds-grew-together",
        measured_rows(lambda i: 1.0),
        measured_rows(lambda i: 1.5 * NOISE[i % len(NOISE)]),
        defect=True,
        why="every measured bound of one rule grew x1.5 (geometric mean): a changed multiplier or floor, not kernel noise",
    ),
    ReviewCase(
        "review-gate-row-vanished",
        rows(
            {"case": "kept", "metric": "max_abs", "value": 1e-6, "threshold": 1e-5, "bound": FIXED},
            {"case": "gone", "metric": "max_abs", "value": 1e-6, "threshold": 1e-5, "bound": FIXED},
        ),
        rows({"case": "kept", "metric": "max_abs", "value": 1e-6, "threshold": 1e-5, "bound": FIXED}),
        defect=True,
        why="a gate row of a suite that ran is gone: a check that stopped running (vllm-project/vllm-omni#7455's tests that passed on eager code)",
    ),
]


def write_run(directory: Path, frame: pd.DataFrame) -> Path:
    directory.mkdir(parents=True)
    frame.to_csv(directory / RESULTS_FILE, index=False)
    return directory


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_review_finds_what_a_crafted_run_holds(case: ReviewCase, report, target, tmp_path: Path) -> None:
    """`target` is requested so that a harness variant named by `--parity-target` (a report mutant
    of the sensitivity catalogue) is applied in this session before the review runs."""
    baseline = write_run(tmp_path / "baseline", case.baseline)
    run = write_run(tmp_path / "run", case.run)
    comparison = load_review(run, baseline=baseline / RESULTS_FILE).comparison
    assert comparison is not None
    found = len(comparison.regressions) + comparison.vanished_gate_rows
    whys = "; ".join(str(w) for w in comparison.regressions["why"]) or "no regression"
    detail = (
        f"{case.why}: {len(comparison.regressions)} regression(s), {comparison.vanished_gate_rows} vanished gate row(s) ({whys})"
    )
    if case.defect:
        verdict = count_rule(found, 1, metric="review_findings", at=AT_LEAST, detail=detail)
    else:
        verdict = count_rule(found, 0, metric="review_findings", at=AT_MOST, detail=detail)
    report.verdict(verdict, case=case.name)

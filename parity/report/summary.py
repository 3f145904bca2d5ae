"""What a run says about itself in a few lines: per suite its cases by verdict and the row
nearest its bound (`summarize`), the families it left out, and whether anything failed (`outcome`).

Pure functions of a run's rows (`parity.report.run_files.RunFiles`): `parity run` prints them after
pytest, `parity review` and the page read the same frame.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from parity.compare import ERROR, FAIL, NOT_APPLICABLE, PASS, SKIP, TIE_FLIP
from parity.report.run_files import RunFiles
from parity.report.schema import CASE_KEYS, NOT_PROVIDED

# A case with a passing row and rows that do not apply passes; a case whose rows all do not apply is
# `not_applicable`; a case (test) that pytest skipped has one `skip` row and counts as `skip`.
SUMMARY_COLUMNS = ["suite", "cases", "pass", "fail", "tie_flip", "error", "not_applicable", "skip", "worst"]
_SEVERITY = {SKIP: -2, NOT_APPLICABLE: -1, PASS: 0, TIE_FLIP: 1, FAIL: 2, ERROR: 3}


def case_verdicts(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (suite, case, target, mode): the worst verdict among its gate rows (a skipped
    test's `skip` row, an info row, counts for a case with no gate row)."""
    gates = frame[((frame["kind"] != "info") | (frame["verdict"] == SKIP)) & (frame["metric"] != NOT_PROVIDED)]
    if gates.empty:
        return pd.DataFrame(columns=CASE_KEYS + ["verdict"])
    worst = gates.assign(severity=gates["verdict"].map(_SEVERITY)).groupby(CASE_KEYS, sort=False)["severity"].max()
    names = {v: k for k, v in _SEVERITY.items()}
    return worst.map(names).rename("verdict").reset_index()


def _badness(row: Any) -> float:
    """How close a gate row came to its bound (1.0 = at the bound, > 1 = over it); `row` has the
    columns as attributes (a row of `DataFrame.itertuples`)."""
    value, threshold = row.value, row.threshold
    if row.verdict == ERROR:
        return math.inf
    if row.verdict in (NOT_APPLICABLE, SKIP) or pd.isna(value) or pd.isna(threshold):
        return -math.inf
    if row.better == "equal":
        return 0.0 if value == threshold else math.inf
    if row.better == "higher":
        return threshold / value if value not in (0, math.inf) else (0.0 if value == math.inf else math.inf)
    if threshold == 0:
        return 0.0 if value == 0 else math.inf
    return value / threshold


CAUSE_CHARS = 120  # an error's cause in the summary's worst column: the type, the place, the message's start


def error_cause(detail: str) -> str:
    """An error row's detail cut to its first line (`RuntimeError (at model.py:179 in moe): ...`)."""
    line = detail.split(" | ", 1)[0].strip()
    return line if len(line) <= CAUSE_CHARS else line[: CAUSE_CHARS - 3] + "..."


def summarize(frame: pd.DataFrame, seconds: Mapping[str, float] | None = None) -> pd.DataFrame:
    """Per suite: cases, pass, fail, tie_flip, error, not_applicable, skip and the gate row nearest
    to (or past) its bound; with `seconds` (run.json's `suite_seconds`) also the seconds its tests took."""
    verdicts = case_verdicts(frame)
    rows = []
    for suite, group in verdicts.groupby("suite", sort=True):
        counts = group["verdict"].value_counts()
        gates = frame[(frame["suite"] == suite) & (frame["kind"] != "info")]
        worst = ""
        if not gates.empty:
            scored = gates.assign(badness=[_badness(row) for row in gates.itertuples(index=False)])
            top = scored.sort_values("badness", ascending=False, kind="stable").iloc[0]
            if top["verdict"] == ERROR:  # no value to show: the error's one-line cause and where it was raised
                worst = f"{top['metric']}: {error_cause(str(top['detail']))} [{top['case']}/{top['mode']}]"
            elif top["badness"] != -math.inf:
                # The direction the value is held to: `block_compiles=2 (bound ≥ 1)` reads right, `(bound 1)` does not.
                relation = {"higher": "≥ ", "lower": "≤ ", "equal": "= "}.get(str(top.get("better", "")), "")
                bound = "" if pd.isna(top["threshold"]) else f" (bound {relation}{top['threshold']:.4g})"
                worst = f"{top['metric']}={top['value']:.4g}{bound} [{top['case']}/{top['mode']}]"
        rows.append(
            {
                "suite": suite,
                "cases": len(group),
                "pass": int(counts.get(PASS, 0)),
                "fail": int(counts.get(FAIL, 0)),
                "tie_flip": int(counts.get(TIE_FLIP, 0)),
                "error": int(counts.get(ERROR, 0)),
                "not_applicable": int(counts.get(NOT_APPLICABLE, 0)),
                "skip": int(counts.get(SKIP, 0)),
                "worst": worst,
            }
        )
    summary = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    if seconds:
        summary.insert(len(SUMMARY_COLUMNS) - 1, "seconds", [round(seconds.get(s, math.nan), 1) for s in summary["suite"]])
    return summary


def run_tp(frame: pd.DataFrame) -> int:
    """The tensor-parallel size of a run's (or baseline's) rows; 1 where the column is empty (a
    single-process run's rows written without it)."""
    if "tp" not in frame.columns:
        return 1
    sizes = {int(float(v)) for v in frame["tp"] if str(v) not in ("", "nan")}
    return max(sizes) if sizes else 1


def format_summary(summary: pd.DataFrame, frame: pd.DataFrame | None = None) -> str:
    """The summary table; with the run's rows, a line per family (or suite) the target left out."""
    lines = [summary.to_string(index=False)] if not summary.empty else []
    lines += not_provided_lines(frame) if frame is not None else []
    return "\n".join(lines) or "(no report rows)"


def not_provided_lines(frame: pd.DataFrame) -> list[str]:
    """One line per family the run left out (its `NOT_PROVIDED` rows): the suites and tests not
    run and why, in place of a skip row per test."""
    rows = frame[frame["metric"] == NOT_PROVIDED]
    lines = []
    for (family, reason), group in rows.groupby(["case", "detail"], sort=False):
        tests = int(pd.to_numeric(group["value"], errors="coerce").fillna(0).sum())
        suites = ", ".join(dict.fromkeys(group["suite"]))
        lines.append(f"not run: {family} ({suites}: {tests} tests): {reason}")
    return lines


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """What a finished run says about itself: the summary and whether anything failed."""

    rows: int
    summary: pd.DataFrame
    failed_cases: int

    @property
    def ok(self) -> bool:
        return self.failed_cases == 0


def outcome(run: RunFiles | str | Path) -> RunOutcome:
    """The summary of a run read once (`RunFiles`; a run directory is read here) and whether anything failed."""
    if not isinstance(run, RunFiles):
        run = RunFiles.read(run)
    summary = summarize(run.frame, run.info.get("suite_seconds"))
    failed = int(summary["fail"].sum() + summary["error"].sum()) if not summary.empty else 0
    return RunOutcome(len(run.frame), summary, failed)

"""The review page's decode view as data: per failing decode run, the step where the tokens
diverged, both sequences with the differing tokens marked, and the step logits' error per step.

The decode suite's rows (parity.suites.ar.test_decode): the free-running gate `matched_steps`
(value: steps whose tokens equal the reference's, threshold: the case's steps), `tokens` info rows
(site `reference` / `target`; the ids in the row's data, `tokens`), per-bucket teacher-forced rows
(`teacher_forced.steps.A-B`) and `step_max_abs` (site `teacher_forced`; the per-step values in the
row's data, `steps`). Nothing is read back out of a row's detail (docs/reports.md §4).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import pandas as pd

from parity.compare import ERROR, FAIL, PASS, TIE_FLIP
from parity.report.html import Assets, gate_verdict, table
from parity.report.plots import decode_step_plot
from parity.report.review import failing_first
from parity.report.schema import row_data

MAX_DECODE_DETAILS = 12  # failing decode runs drawn in full; more are listed in the table
STEP_ERRORS = "teacher-forced, largest |d| per step"


def _number(value: Any) -> float | None:  # a cell of the rows' frame
    return None if value is None or pd.isna(value) else float(value)


@dataclasses.dataclass
class DecodeRun:
    """One decode case in one mode: its verdict, where its tokens diverged, both sequences, the
    step logits' error per step."""

    case: str
    mode: str
    rows: pd.DataFrame

    @functools.cached_property
    def verdict(self) -> str:
        return gate_verdict(self.rows)

    def _one(self, metric: str, site: str | None = None) -> pd.Series | None:
        mine = self.rows[(self.rows["metric"] == metric) & ((self.rows["site"] == site) if site is not None else True)]
        return mine.iloc[-1] if not mine.empty else None

    @functools.cached_property
    def tokens(self) -> dict[str, list[list[int]]]:
        found = {}
        for side in ("target", "reference"):
            row = self._one("tokens", side)
            sequences = row_data(row["data"]).get("tokens") if row is not None else None
            if sequences:
                found[side] = [[int(token) for token in sequence] for sequence in sequences]
        return found

    @property
    def steps(self) -> int | None:
        matched = self._one("matched_steps")
        if matched is not None and _number(matched["threshold"]) is not None:
            return int(matched["threshold"])
        return max((len(r) for rows in self.tokens.values() for r in rows), default=None)

    @property
    def matched(self) -> int | None:
        row = self._one("matched_steps")
        return int(row["value"]) if row is not None and _number(row["value"]) is not None else None

    @property
    def diverged_at(self) -> int | None:
        """The first step whose token differs from the reference's (any batch row), or None."""
        if len(self.tokens) == 2:
            pairs = list(zip(self.tokens["reference"], self.tokens["target"]))
            steps = [i for want, got in pairs for i, (a, b) in enumerate(zip(want, got)) if a != b]
            steps += [min(len(w), len(g)) for w, g in pairs if len(w) != len(g)]
            return min(steps) if steps else None
        matched, total = self.matched, self.steps
        return matched if matched is not None and total is not None and matched < total else None

    def step_errors(self) -> tuple[str, list[float]] | None:
        """(label, per-step values) of the `step_max_abs` row; None when the run has none."""
        row = self._one("step_max_abs")
        values = row_data(row["data"]).get("steps") if row is not None else None
        return (STEP_ERRORS, [float(v) for v in values]) if values else None

    @property
    def largest_step_diff(self) -> float:
        errors = self.step_errors()
        finite = [v for v in errors[1] if not math.isnan(v)] if errors else []
        return max(finite) if finite else math.nan

    @property
    def detail(self) -> str:
        row = self._one("matched_steps")
        return row["detail"] if row is not None else " | ".join(dict.fromkeys(d for d in self.rows["detail"] if d))

    def headline(self) -> str:
        steps, matched, diverged = self.steps, self.matched, self.diverged_at
        if diverged is not None:
            return (
                f"tokens diverged at step {diverged}"
                + (f" of {steps}" if steps is not None else "")
                + (f" (the first {diverged} tokens equal the reference's)" if diverged else " (the first token already differs)")
            )
        if matched is not None:
            return f"tokens equal the reference's at all {matched} steps; the step logits failed"
        return "no free-running result in this run"


def _token_rows(run: DecodeRun) -> list[dict[str, Any]]:
    """Both sequences, each token marked where it differs from the other side's at the same step."""
    reference, target = run.tokens["reference"], run.tokens["target"]
    out = []
    for side, mine, other in (("target", target, reference), ("reference", reference, target)):
        for row, tokens in enumerate(mine):
            others = other[row] if row < len(other) else []
            marked = [(t, i >= len(others) or others[i] != t) for i, t in enumerate(tokens)]
            out.append({"side": side, "row": row, "tokens": marked})
    return out


def _failing_run(run: DecodeRun, i: int, assets: Assets) -> dict[str, Any]:
    where = f"{run.case} / {run.mode}"
    gates = failing_first(run.rows[(run.rows["kind"] != "info") & run.rows["verdict"].isin((FAIL, ERROR))])
    data: dict[str, Any] = {
        "i": i,
        "where": where,
        "verdict": run.verdict,
        "headline": run.headline(),
        "gates": table(gates, ("verdict", "site", "metric", "value", "threshold", "detail"), table_id=f"decode-failing-{i}"),
        "tokens": _token_rows(run) if len(run.tokens) == 2 else None,
        "figure": None,
    }
    errors = run.step_errors()
    drawn = (
        decode_step_plot([errors], assets.path(f"decode-{run.case}-{run.mode}"), f"{where}: step logits", run.diverged_at)
        if errors
        else None
    )
    if drawn is not None and errors is not None:
        path, caption = drawn
        text = f"{where}: {errors[0]}, log scale" + (
            "; dotted line: the step where the tokens diverged" if run.diverged_at is not None else ""
        )
        data["figure"] = assets.figure(path, f"{where}: step logits error by step", text + (f"; {caption}" if caption else ""))
    return data


def decode_view(review: Any, rows: pd.DataFrame, assets: Assets) -> dict[str, Any]:
    runs = [DecodeRun(case, mode, group) for (case, mode), group in rows.groupby(["case", "mode"], sort=False)]
    failing = [run for run in runs if run.verdict in (FAIL, ERROR)]
    flips = sum(run.verdict == TIE_FLIP for run in runs)
    data: dict[str, Any] = {
        "runs": len(runs),
        "failing": len(failing),
        "flips": flips,
        "passing": sum(run.verdict == PASS for run in runs),
        "details": [_failing_run(run, i, assets) for i, run in enumerate(failing[:MAX_DECODE_DETAILS])],
        "rest": None,
    }
    drawn_in_full = {id(run) for run in failing[:MAX_DECODE_DETAILS]}
    rest = [run for run in runs if id(run) not in drawn_in_full]
    if rest:
        more = len(failing) - len(drawn_in_full)
        title = "Passing decode runs" + (" and tie flips" if flips else "") + (f", and {more} more failing" if more else "")
        frame = pd.DataFrame(
            [
                {
                    "case": run.case,
                    "mode": run.mode,
                    "verdict": run.verdict,
                    "steps_matched": f"{run.matched} of {run.steps}" if run.matched is not None and run.steps is not None else "",
                    "diverged_at": run.diverged_at if run.diverged_at is not None else "",
                    "largest_step_diff": run.largest_step_diff,
                    "detail": run.detail,
                }
                for run in rest
            ]
        )
        frame = failing_first(frame.assign(kind="gate", value=math.nan, threshold=math.nan, better=""))
        columns = ("case", "mode", "verdict", "steps_matched", "diverged_at", "largest_step_diff", "detail")
        data["rest"] = (title, table(frame, columns, table_id="decode-runs"))
    return data

"""The review's audit: every row of a results file judged again from its own numbers.

`parity review` takes nothing in `results.csv` on trust (docs/reports.md §1). Each record is read
as text, as written, and checked twice:

* **Is it a parity row?** Its verdict, kind, `better` and `bound` are values the writer writes,
  its value and threshold are numbers or empty, it is not the header line again (two files joined),
  and every row carries the same run id, target, device, dtype, size and torch version, which
  `run.json` repeats. A file that fails here is not one run's rows: the review stops (exit 2).
* **Does its verdict follow from its numbers?** A gate row's verdict is derived again from value,
  threshold and direction with the suites' own rules (`parity.compare.rules`: inclusive bounds,
  NaN never passes, +inf passes only where higher is better; a `tie_flip` is a decision outside
  its bound that the noise excuses, and only decisions have one; `error`, `not_applicable`, `skip`
  carry no bound). An info row never fails a review, so one that records a failure its case's
  gate rows do not is a failure hidden as info. A disagreement fails the review (exit 1).

Every problem names the file, the line and the row (suite/case/mode/site/metric), or the run.json key.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from parity.compare import BOUND_KINDS, ERROR, FAIL, MEASURED, NOT_APPLICABLE, PASS, SKIP, TIE_FLIP, VERDICTS
from parity.compare.metrics import DECISION_METRICS
from parity.report.rows import Records, read_records
from parity.report.schema import BETTER, KINDS, RUN_INFO_FILE, row_data

# What a number looks like as the writer writes it (repr of a float or an int, `nan`, `inf`).
# Stricter than float() on purpose: `1_000` or ` 1` are not what a parity writer writes.
_NUMBER = re.compile(r"[+-]?((\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?|inf|infinity|nan)", re.IGNORECASE)
# Columns every row of one run shares, and the run.json key that repeats each (docs/reports.md §1).
PROVENANCE = {
    "run_id": "run_id",
    "target": "target",
    "device": "device",
    "dtype": "dtype",
    "size": "size",
    "torch_version": "torch",
    "tp": "tp",  # a tensor-parallel run's size (docs/targets.md §11): rows of two sizes are two runs
}
# The metrics whose gate row decides a discrete choice the dtype's noise can flip (the metrics
# table's `decision`, parity.compare.metrics: a greedy token's `matched_steps`, a router's
# `ids_mismatch`). docs/tolerances.md §3: only these can be a `tie_flip`.
# noise_floor_rule passes a candidate allclose to the eager reference before its RMSE test, and
# says so in the detail: the one pass whose row's value may exceed its threshold (docs/tolerances.md §2).
PRECHECK_PASS = "allclose to eager"
SHOWN = 20  # problems printed before "... N more"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing the audit will not accept, located."""

    where: str  # `results.csv line 7 (numerics/c/eager @layer.3 max_abs)` or `run.json key 'device'`
    what: str
    unusable: bool  # True: not a parity row / not one run (exit 2); False: a verdict its numbers contradict (exit 1)

    def line(self) -> str:
        return f"{self.where}: {self.what}"


@dataclasses.dataclass
class Audit:
    """What the audit of one results file found."""

    source: Path
    rows: int = 0
    problems: list[Problem] = dataclasses.field(default_factory=list)

    @property
    def unusable(self) -> list[Problem]:
        return [p for p in self.problems if p.unusable]

    @property
    def disagreements(self) -> list[Problem]:
        return [p for p in self.problems if not p.unusable]

    @property
    def ok(self) -> bool:
        return not self.problems


def shown_lines(problems: Sequence[Problem], limit: int = SHOWN) -> list[str]:
    """The problems' lines, at most `limit` of them, then how many more there are."""
    lines = [p.line() for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"... {len(problems) - limit} more")
    return lines


def _number(text: str) -> float | None:
    """The number a cell holds (None when empty); ValueError when it holds something else."""
    if text == "":
        return None
    if not _NUMBER.fullmatch(text):
        raise ValueError(text)
    return float(text)


def _where(path: Path, line: int, record: Mapping[str, str]) -> str:
    site = f" @{record.get('site', '')}" if record.get("site") else ""
    key = f"{record.get('suite', '')}/{record.get('case', '')}/{record.get('mode', '')}{site} {record.get('metric', '')}"
    return f"{path.name} line {line} ({key})"


# ---------------------------------------------------------------------------------------------
# One row
# ---------------------------------------------------------------------------------------------


def _listed(values: Iterable[str]) -> str:
    return ", ".join(v or "''" for v in values)


def row_problem(record: Mapping[str, str], header: Sequence[str]) -> str | None:
    """Why `record` is not a parity row as the writer writes one (None: it is)."""
    if list(record.values()) == list(header) or record.get("verdict") == "verdict":
        return "the header line again: two results files joined into one?"
    for column in ("suite", "case", "metric", "verdict"):
        if record.get(column, "") == "":
            return f"empty {column}"
    checks = (
        ("verdict", VERDICTS),
        ("kind", KINDS),
        ("better", BETTER),
        ("bound", BOUND_KINDS),
    )
    for column, allowed in checks:
        value = record.get(column, "")
        if value not in allowed:
            return f"{column} {value!r} is not one of {_listed(allowed)}"
    for column in ("value", "threshold"):
        try:
            _number(record.get(column, ""))
        except ValueError:
            return f"{column} {record[column]!r} is not a number"
    try:
        row_data(record.get("data", ""))
    except ValueError as exc:
        return f"data {record['data'][:80]!r} is not a JSON object ({exc}; docs/reports.md §4)"
    return None


def _holds(value: float, threshold: float, better: str) -> bool:
    """The bound, inclusive, in the row's direction (`parity.compare.rules._holds`; NaN never holds)."""
    if math.isnan(value) or math.isnan(threshold):
        return False
    if better == "higher":
        return value >= threshold
    if better == "equal":
        return value == threshold
    return value <= threshold  # `lower`, and a gate row written without a direction (the writer's default)


def _bound_text(value: float, threshold: float, better: str) -> str:
    direction = better or "lower"
    relation = {"lower": "at most", "higher": "at least", "equal": "exactly"}[direction]
    return f"value {value:.6g} against {relation} {threshold:.6g} ({direction} is better)"


def verdict_problem(record: Mapping[str, str]) -> str | None:
    """Why a gate row's recorded verdict is not the one its numbers give (None: they agree).

    `record` is a parity row (`row_problem` found nothing)."""
    verdict, metric, better = record["verdict"], record["metric"], record.get("better", "")
    value, threshold = _number(record.get("value", "")), _number(record.get("threshold", ""))
    if verdict == ERROR:
        return None  # the check raised: nothing was judged, and the row fails the review as it is
    if verdict in (NOT_APPLICABLE, SKIP):
        if threshold is not None:
            return f"recorded {verdict}, but the row holds a threshold ({threshold:.6g}): a row held to a bound was judged"
        return None
    if verdict == TIE_FLIP and metric not in DECISION_METRICS:
        return (
            f"recorded tie_flip, but {metric} is not a decision (a tie flip is a greedy token or expert choice inside "
            f"the dtype's noise: {', '.join(DECISION_METRICS)})"
        )
    if verdict == FAIL and (value is None or threshold is None):
        return None  # an assertion's row: a failure with no number
    if value is None:
        return f"recorded {verdict} with no value: nothing to derive the verdict from"
    if verdict == PASS and (math.isnan(value) or (math.isinf(value) and not (value > 0 and better == "higher"))):
        return f"recorded pass with value {value}: a non-finite value passes only as +inf where higher is better"
    if threshold is None:
        if verdict == PASS:
            return None  # a measurement held to no bound (a benchmark's ratio): pass is all it can record
        return f"recorded {verdict} with no threshold: nothing to derive the verdict from"
    holds = _holds(value, threshold, better)
    numbers = _bound_text(value, threshold, better)
    if verdict == PASS:
        if not math.isfinite(threshold):
            return f"recorded pass against a threshold of {threshold}: a non-finite bound judges nothing"
        if not holds:
            if record.get("bound") == MEASURED and PRECHECK_PASS in record.get("detail", ""):
                return None
            return f"recorded pass, derived fail: {numbers}"
        return None
    if verdict == TIE_FLIP:
        return f"recorded tie_flip, derived pass: {numbers} (a tie flip is a decision that differs)" if holds else None
    # FAIL: a non-finite comparison fails whatever max_abs says (its detail says "non-finite").
    if holds and "non-finite" not in record.get("detail", ""):
        return f"recorded fail, derived pass: {numbers}"
    return None


# ---------------------------------------------------------------------------------------------
# A whole file
# ---------------------------------------------------------------------------------------------


def audit_records(records: Records, info: Mapping[str, Any] | None = None) -> Audit:
    """Every problem of `records` (and, with `info`, of run.json against them)."""
    found = Audit(records.path, rows=len(records.whole))
    path = records.path
    parity_rows: list[tuple[int, dict[str, str]]] = []
    for line, record in records.whole:
        problem = row_problem(record, records.header)
        if problem:
            found.problems.append(Problem(_where(path, line, record), problem, unusable=True))
        else:
            parity_rows.append((line, record))
    found.problems += _provenance_problems(path, parity_rows, info or {})
    failing: dict[tuple[str, ...], set[str]] = {}
    for _, record in parity_rows:
        if record["kind"] == "gate":
            failing.setdefault(_case(record), set()).add(record["verdict"])
    for line, record in parity_rows:
        problem = (
            verdict_problem(record) if record["kind"] == "gate" else _info_problem(record, failing.get(_case(record), set()))
        )
        if problem:
            found.problems.append(Problem(_where(path, line, record), problem, unusable=False))
    for line in (info or {}).get("rank_disagreements") or ():
        # a tensor-parallel peer judged gate rows otherwise (parity.plugin.ranks): the rows of rank 0 alone
        # cannot be believed (docs/reports.md §1)
        found.problems.append(Problem(f"{RUN_INFO_FILE} key 'rank_disagreements'", str(line), unusable=False))
    return found


def _case(record: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(record.get(k, "") for k in ("suite", "case", "target", "mode"))


def _info_problem(record: Mapping[str, str], gate_verdicts: set[str]) -> str | None:
    """An info row decides nothing and never fails a review: one recording a failure its case's gate
    rows do not record hides it; one held to a bound must meet it."""
    verdict = record["verdict"]
    worse = {FAIL: (FAIL, ERROR), ERROR: (FAIL, ERROR), TIE_FLIP: (TIE_FLIP, FAIL, ERROR)}.get(verdict)
    if worse is not None and not gate_verdicts & set(worse):
        return (
            f"an info row recorded {verdict}, but no gate row of its case is {' or '.join(worse)}: "
            "a failure recorded as info passes the review silently"
        )
    if verdict == PASS:
        value, threshold = _number(record.get("value", "")), _number(record.get("threshold", ""))
        if value is not None and threshold is not None and not _holds(value, threshold, record.get("better", "")):
            return f"an info row recorded pass, derived fail: {_bound_text(value, threshold, record.get('better', ''))}"
    return None


def _provenance_problems(path: Path, rows: list[tuple[int, dict[str, str]]], info: Mapping[str, Any]) -> list[Problem]:
    """Rows of one run share their run id, target, device, dtype, size and torch version, and
    run.json says the same."""
    problems = []
    for column, key in PROVENANCE.items():
        present = [(line, record) for line, record in rows if column in record]
        if not present:
            continue
        first_line, first = present[0][0], present[0][1][column]
        other = next(((line, record) for line, record in present if record[column] != first), None)
        if other is not None:
            line, record = other
            problems.append(
                Problem(
                    _where(path, line, record),
                    f"{column} {record[column]!r}, but line {first_line} says {first!r}: rows of several runs or "
                    f"configurations in one file (one run has one {column})",
                    unusable=True,
                )
            )
            continue
        said = info.get(key)
        if said not in (None, "") and first != "" and str(said) != first:
            problems.append(
                Problem(
                    f"{RUN_INFO_FILE} key {key!r}",
                    f"says {said!r}, but the rows say {first!r} ({path.name} line {first_line}): run.json and "
                    "results.csv describe different runs",
                    unusable=True,
                )
            )
    return problems


def audit_file(source: str | Path, info: Mapping[str, Any] | None = None) -> Audit:
    """Audit a results file or run directory (with `info`, its run.json)."""
    return audit_records(read_records(source), info)


def rule_changes(baseline: pd.DataFrame, run: pd.DataFrame, keys: Sequence[str], name: str) -> list[Problem]:
    """Gate rows whose rule changed against the baseline: recorded as info now, or read in another
    direction (`better`). Either turns a failing row into one the review does not fail; accept a
    deliberate change by regenerating the baseline."""
    if baseline.empty or run.empty:
        return []
    old = baseline[baseline["suite"].isin(set(run["suite"]))].copy()
    new = run.copy()
    for frame in (old, new):
        frame["_n"] = frame.groupby(list(keys), sort=False).cumcount()
    merged = old.merge(new, on=[*keys, "_n"], how="inner", suffixes=("_old", "_new"))
    changed = merged[
        (merged["kind_old"] == "gate")
        & ((merged["kind_new"] != "gate") | (merged["better_new"] != merged["better_old"]) & (merged["better_old"] != ""))
    ]
    problems = []
    for _, row in changed.iterrows():
        site = f" @{row['site']}" if row["site"] else ""
        where = f"{row['suite']}/{row['case']}/{row['mode']}{site} {row['metric']}"
        if row["kind_new"] != "gate":
            what = f"a gate row in the baseline {name}, recorded as {row['kind_new']} now: it can no longer fail the review"
        else:
            what = (
                f"better {row['better_old']!r} in the baseline {name}, {row['better_new']!r} now: its bound is read the other way"
            )
        problems.append(Problem(where, what, unusable=False))
    return problems

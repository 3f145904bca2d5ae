"""Reviewing a run: what failed (failing rows first, with numbers and bounds), and what changed
against the baseline for its device kind and dtype. `parity review` prints this and writes the
run's `index.html` (parity.report.page); its exit status is what CI gates on.

A run that did not complete is said plainly, first: `run.json`'s status other than `complete`
(interrupted with its signal, crashed, still running or dead while running, none recorded), an
earlier appended session that did not complete, or records of `results.csv` cut short. The review
still reads and reports every whole row.

Nothing in `results.csv` is taken on trust (`parity.report.audit`, docs/reports.md §1): a file
that is not one run's parity rows is refused (exit 2), and a row whose recorded verdict its own
numbers contradict fails the review (exit 1). A run directory or results.csv that is a symbolic
link is refused (docs/reports.md §3).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from parity.compare import ERROR, FAIL, NOT_APPLICABLE, PASS, SKIP, TIE_FLIP
from parity.report.audit import Audit, Problem, audit_records, rule_changes, shown_lines
from parity.report.baseline import (
    BASELINE_DIR,
    BaselineError,
    default_baseline_path,
    device_kind,
    load_rows,
    misplaced_family,
    row_location,
    run_config,
    source_device_kind,
)
from parity.report.case_lines import SuiteLines, failing_case_lines, row_rule
from parity.report.comparison import (
    DEFAULT_MARGIN,
    INFO_LIST_FACTOR,
    Comparison,
    allowance_used,
    compare_rows,
    fmt_value,
)
from parity.report.quick import quick_note
from parity.report.run_files import RunFiles, completeness
from parity.report.run_info import target_name
from parity.report.schema import RESULTS_FILE, ROW_KEYS
from parity.report.summary import format_summary, summarize

# 3: the run did not complete (or its file is torn); `--allow-incomplete` reviews its rows anyway.
EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE, EXIT_INCOMPLETE = 0, 1, 2, 3
_ORDER = {ERROR: 0, FAIL: 1, TIE_FLIP: 2, NOT_APPLICABLE: 3, SKIP: 4, PASS: 5}


def used_share(row: pd.Series) -> float:
    """How much of its bound a row uses (1.0 = at the bound); -inf when it has no bound."""
    used = allowance_used(row["value"], row["threshold"], row["better"])
    return -math.inf if pd.isna(used) else used


def failing_first(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows in review order: error, fail, tie_flip, not_applicable, pass; within each, nearest to its bound first.

    Info rows go after gate rows of the same verdict (they decided nothing).
    """
    if frame.empty:
        return frame
    keyed = frame.assign(
        _verdict=frame["verdict"].map(_ORDER).fillna(len(_ORDER)),
        _info=(frame["kind"] == "info").astype(int),
        _used=-frame.apply(used_share, axis=1),
    )
    keyed = keyed.sort_values(["_verdict", "_info", "_used"], kind="stable")
    return keyed.drop(columns=["_verdict", "_info", "_used"])


def failing_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Gate rows whose verdict is fail or error, in review order."""
    gates = frame[(frame["kind"] != "info") & frame["verdict"].isin((FAIL, ERROR))]
    return failing_first(gates)


def failing_suites_first(summary: pd.DataFrame) -> pd.DataFrame:
    """Summary rows ordered: suites with errors, then failures, then tie flips, then by name."""
    if summary.empty:
        return summary
    order = summary[["error", "fail", "tie_flip"]].mul(-1).assign(suite=summary["suite"])
    return summary.loc[order.sort_values(["error", "fail", "tie_flip", "suite"], kind="stable").index]


@dataclasses.dataclass
class Review:
    """A run's rows, its summary, its environment and (when one applies) the baseline comparison."""

    run_dir: Path
    frame: pd.DataFrame
    info: dict[str, Any]
    comparison: Comparison | None = None
    baseline_note: str = ""
    baseline_migration: str = ""  # the baseline was made with another --target value of the same target
    incomplete: list[str] = dataclasses.field(default_factory=list)  # why the run is not whole, one line each
    audit: Audit | None = None  # what the audit of results.csv found (None: not audited)
    rule_changes: list[Problem] = dataclasses.field(default_factory=list)  # gate rows whose rule changed against the baseline

    @property
    def unusable(self) -> list[Problem]:
        """Why the rows are not one run's parity rows (exit 2); empty when they are."""
        return self.audit.unusable if self.audit is not None else []

    @property
    def disagreements(self) -> list[Problem]:
        """Rows whose recorded verdict their numbers contradict, and gate rows whose rule changed."""
        return (self.audit.disagreements if self.audit is not None else []) + self.rule_changes

    @property
    def complete(self) -> bool:
        return not self.incomplete

    @functools.cached_property
    def summary(self) -> pd.DataFrame:
        return summarize(self.frame)

    @functools.cached_property
    def failing(self) -> pd.DataFrame:
        return failing_rows(self.frame)

    @property
    def ok(self) -> bool:
        comparison_ok = self.comparison is None or self.comparison.ok
        return self.failing.empty and comparison_ok and not self.disagreements and not self.unusable

    @property
    def title(self) -> str:
        run_id = self.info.get("run_id") or self.run_dir.name
        return f"parity review: {run_id}"

    def status_line(self) -> str:
        failing_cases = int(self.summary[["fail", "error"]].to_numpy().sum()) if not self.summary.empty else 0
        parts = [f"{failing_cases} failing case(s)"]
        if self.unusable:
            parts.append(f"{len(self.unusable)} row(s) or key(s) that are not one run's parity rows")
        if self.disagreements:
            parts.append(f"{len(self.disagreements)} row(s) the audit contradicts")
        if self.comparison is not None:
            parts.append(f"{len(self.comparison.regressions)} regression(s)")
            parts.append(f"{self.comparison.vanished_gate_rows} vanished gate row(s)")
            parts.append(f"{len(self.comparison.improvements)} improvement(s)")
        verdict = ("OK: " if self.ok else "FAILED: ") + ", ".join(parts)
        if not self.complete:
            return f"INCOMPLETE RUN ({len(self.incomplete)} reason(s) above); of the {len(self.frame)} whole rows it wrote: {verdict}"
        return verdict


def load_review(
    run: str | Path | RunFiles,
    *,
    baseline: str | Path | None = None,
    use_default_baseline: bool = True,
    margin: float = DEFAULT_MARGIN,
    baseline_dir: Path = BASELINE_DIR,
    suite_families: Mapping[str, Collection[str]] | None = None,
) -> Review:
    """Review a run (a run directory is read once here, `RunFiles`) and compare it with `baseline`
    (a run directory or CSV) or, when none is given and `use_default_baseline`, with
    `baseline_dir/<device kind>-<dtype>.csv` if that exists (another target's `<device kind>-<dtype>-<name>.csv`:
    docs/reports.md "Migrating"). `suite_families` (`parity.target.suite_families`): a baseline
    row whose family column its suite cannot have is a `BaselineError` (`misplaced_family`)."""
    files = run if isinstance(run, RunFiles) else RunFiles.read(run)
    run_dir, frame, info = files.run_dir, files.frame, files.info
    review = Review(run_dir=run_dir, frame=frame, info=info, incomplete=completeness(files))
    review.audit = audit_records(files.records, info)
    if review.unusable:
        return review  # not one run's parity rows: nothing below would mean anything
    by_name = False  # the baseline was found by the target's declared name (docs/reports.md "Migrating")
    if baseline is None and use_default_baseline and not frame.empty:
        candidate = default_baseline_path(run_dir, frame, baseline_dir, info=info)
        if candidate.exists():
            baseline, by_name = candidate, bool(target_name(info))
        else:
            review.baseline_note = f"no baseline for this device kind, dtype and target at {candidate}" + quick_note(frame)
    if baseline is not None:
        rows = load_rows(baseline, strict=True)
        misplaced = misplaced_family(rows, suite_families, str(baseline)) if suite_families else None
        if misplaced:
            raise BaselineError(misplaced)
        if by_name:
            rows = _same_target_renamed(rows, frame, review)
        run_kind = None
        if not frame.empty:
            run_kind = device_kind(run_config(frame, str(run_dir))["device"], str(info.get("device_name", "")))
            if run_kind == "cuda":  # no device name recorded: the kind is unknown
                run_kind = None
        review.comparison = compare_rows(
            rows, frame, margin=margin, name=str(baseline), baseline_kind=source_device_kind(baseline, rows), run_kind=run_kind
        )
        review.rule_changes = rule_changes(rows, frame, ROW_KEYS, str(baseline))
    return review


def _same_target_renamed(rows: pd.DataFrame, frame: pd.DataFrame, review: Review) -> pd.DataFrame:
    """A baseline found by the target's declared name whose rows name another `--target` value (the
    adapter module was renamed, the target is the same): compared as this run's target, said in one
    line. Rows of another device, dtype or size stay a mismatch the comparison refuses."""
    specs = sorted(set(rows["target"]) - {""})
    spec = str(frame["target"].iloc[0])
    if len(specs) != 1 or specs[0] == spec:
        return rows
    review.baseline_migration = (
        f"baseline rows were made with --target {specs[0]}; this run's --target {spec} declares the same name "
        f'({target_name(review.info)!r}): compared as one target (docs/reports.md "Migrating")'
    )
    return rows.assign(target=spec)


# Rows that differ only in their mode are one line of the review: one defect seen in every mode.
GROUP_KEYS = ("suite", "case", "site", "metric", "verdict")


def group_across_modes(rows: pd.DataFrame) -> list[pd.DataFrame]:
    """`rows` (in review order) in groups that differ only in `mode`, in the order of each group's
    first row; within a group the rows keep review order, so the first is the worst (the most of
    its bound used)."""
    if rows.empty:
        return []
    keys = list(GROUP_KEYS)
    return [group for _, group in rows.groupby(keys, sort=False, dropna=False)]


def group_modes(group: pd.DataFrame) -> list[str]:
    """The modes of a group, in the order their rows were written (`-` for a row without one)."""
    modes = group.sort_index()["mode"]
    return list(dict.fromkeys("-" if pd.isna(mode) or mode == "" else str(mode) for mode in modes))


def _group_line(group: pd.DataFrame, *, rules: list[str] | None = None) -> str:
    """One line for rows of one check that differ only in mode: the modes, the worst value and its
    bound, how many rows the line stands for and the worst row's detail; a rule paragraph at the
    end of the detail is said once per suite (`rules`, numbered from 1: the line names its number)."""
    worst = group.iloc[0]
    site = f" @{worst['site']}" if worst["site"] else ""
    value = "" if pd.isna(worst["value"]) else f"{worst['value']:.4g}"
    if value and len(group) > 1:
        value = f"worst {value}"
    bound = "no bound" if pd.isna(worst["threshold"]) else f"bound {worst['threshold']:.4g}, {worst['better'] or 'n/a'} is better"
    text, rule = row_rule(worst)
    if rule and rules is not None:
        if rule not in rules:
            rules.append(rule)
        bound += f", rule {rules.index(rule) + 1}"
    elif rule:
        text = str(worst["detail"])
    rows = f"; {len(group)} rows" if len(group) > 1 else ""
    detail = f": {text}" if text else ""
    if len(detail) > 200:
        detail = detail[:197] + "..."
    where = f"{worst['suite']}/{worst['case']}{site} {worst['metric']} [{', '.join(group_modes(group))}]"
    value = f" {value}" if value else ""
    return f"  {worst['verdict']:<8} {where}{value} ({bound}{rows}){detail}"


def format_review(review: Review, *, show_all: bool = False, limit: int = 20) -> str:
    """Terminal text: per suite (failing suites first) its counts and failing rows, then the baseline.
    Rows that differ only in mode are one line naming the modes, with the worst value and the
    number of rows (`group_across_modes`); at most `limit` lines per suite."""
    frame = review.frame
    config = ", ".join(f"{k} {review.info.get(k) or _one(frame, k)}" for k in ("target", "device", "dtype", "size") if k in frame)
    lines = [f"{review.title} ({config}; git {review.info.get('git_sha', '?')}; torch {review.info.get('torch', '?')})", ""]
    for problem in review.incomplete:
        lines.append(f"INCOMPLETE RUN: {problem}")
    if review.incomplete:
        lines += [f"(the review below covers the {len(review.frame)} whole rows of {review.run_dir / RESULTS_FILE})", ""]
    if review.disagreements:
        lines.append(f"AUDIT: {len(review.disagreements)} row(s) whose recorded verdict or rule their own numbers contradict:")
        lines += [f"  {line}" for line in shown_lines(review.disagreements, limit)]
        lines.append("")
    lines += [format_summary(review.summary, frame), ""]
    summary = review.summary
    summary = failing_suites_first(summary)
    cases = failing_case_lines(frame)
    for _, suite_row in summary.iterrows():
        suite = suite_row["suite"]
        rows = frame[(frame["suite"] == suite) & (frame["kind"] != "info")]
        shown = failing_first(rows)
        if not show_all:
            shown = shown[shown["verdict"] != PASS]
        if shown.empty:
            continue
        header = f"{suite}: {suite_row['cases']} cases, {suite_row['fail']} fail, {suite_row['error']} error, {suite_row['tie_flip']} tie_flip, {suite_row['not_applicable']} not_applicable, {suite_row['skip']} skip"
        lines.append(header)
        # a failing case is one line (docs/reports.md §8); the other verdicts' rows, one line per check across modes
        suite_lines = cases.get(suite, SuiteLines(suite, [], []))
        lines += [f"  {line.text(review.run_dir)}" for line in suite_lines.lines[:limit]]
        if len(suite_lines.lines) > limit:
            lines.append(
                f"  ... {len(suite_lines.lines) - limit} more failing cases (all of them: {review.run_dir / RESULTS_FILE})"
            )
        groups = group_across_modes(shown[~shown["verdict"].isin((FAIL, ERROR))])
        for group in groups[:limit]:
            lines.append(_group_line(group, rules=suite_lines.rules))
        if len(groups) > limit:
            rest = sum(len(group) for group in groups[limit:])
            lines.append(
                f"  ... {len(groups) - limit} more lines ({rest} rows across modes; all of them: {review.run_dir / RESULTS_FILE})"
            )
        lines += [f"  {text}" for text in suite_lines.rule_lines()]
    lines.append("")
    if review.baseline_migration:
        lines += [review.baseline_migration, ""]
    if review.comparison is not None:
        lines += [format_comparison(review.comparison, limit=limit), ""]
    elif review.baseline_note:
        lines += [review.baseline_note, ""]
    lines.append(review.status_line())
    return "\n".join(lines)


def _one(frame: pd.DataFrame, column: str) -> str:
    values = sorted(set(frame[column]) - {""})
    return "/".join(values) if values else "?"


def latest_run_dir(report_dir: Path) -> Path:
    """The run directory under `report_dir` whose results.csv was written last."""
    runs = [p for p in Path(report_dir).iterdir() if (p / RESULTS_FILE).is_file()] if Path(report_dir).is_dir() else []
    if not runs:
        raise FileNotFoundError(f"no run directories with {RESULTS_FILE} under {report_dir}")
    return max(runs, key=lambda p: (p / RESULTS_FILE).stat().st_mtime)


def format_comparison(comparison: Comparison, *, limit: int = 20) -> str:
    """The comparison as terminal text: regressions, improvements, new and vanished cases, moves."""
    compared = f" of {comparison.config}" if comparison.config else ""
    lines = [
        f"baseline {comparison.baseline}: {comparison.matched} rows{compared} matched, margin {comparison.margin:.0%} of the bound"
    ]
    if comparison.suites_not_run:
        lines.append(f"  not compared (no rows in this run): {', '.join(comparison.suites_not_run)}")
    for why, count in comparison.not_compared.items():
        lines.append(f"  not compared ({count} baseline rows): {why}")
    for title, frame in (
        ("regressions", comparison.regressions),
        ("improvements", comparison.improvements),
    ):
        lines.append(f"  {title}: {len(frame)}")
        lines += [f"    {_row_text(r)}" for _, r in frame.head(limit).iterrows()]
        if len(frame) > limit:
            lines.append(f"    ... {len(frame) - limit} more")
    for title, cases in (("new cases", comparison.new_cases()), ("vanished cases", comparison.vanished_cases())):
        note = " (a vanished gate row fails the review)" if title == "vanished cases" and len(cases) else ""
        lines.append(f"  {title}: {len(cases)}{note}")
        for _, c in cases.head(limit).iterrows():
            lines.append(f"    {c['suite']}/{c['case']}/{c['target']}/{c['mode']} ({c['rows']} rows, {c['gate_rows']} gate)")
        if len(cases) > limit:
            lines.append(f"    ... {len(cases) - limit} more")
    changed = comparison.changed
    lines.append(f"  changed gate rows, neither better nor worse by the rule: {len(changed)}")
    lines += [f"    {_row_text(r)}" for _, r in changed.head(limit).iterrows()]
    if len(changed) > limit:
        lines.append(f"    ... {len(changed) - limit} more")
    large = comparison.large_info_moves()
    lines.append(
        f"  info rows moved more than {comparison.margin:.0%}: {len(comparison.info_moves)} (never a regression); "
        f"by more than x{INFO_LIST_FACTOR:g}: {len(large)}"
    )
    lines += [f"    {_row_text(r)}" for _, r in large.head(limit).iterrows()]
    if len(large) > limit:
        lines.append(f"    ... {len(large) - limit} more")
    return "\n".join(lines)


def _row_text(row: pd.Series) -> str:
    bound = "" if pd.isna(row["threshold"]) else f" (bound {fmt_value(row['threshold'])})"
    return (
        f"{row_location(row)}: {fmt_value(row['old_value']) or '-'} -> {fmt_value(row['new_value']) or '-'}{bound}: {row['why']}"
    )

"""A failing case in one line, and each tolerance rule once per suite.

`case/mode: blamed stage — metric value (bound) — repro path`: where the case diverges (the stage
its localisation blamed, the compiled piece that differs, else the first failing site), the gate
row that failed first in layer order with its value and bound, and the repro to run. At most
`LINE_CHARS` characters before the repro path; the lines of a suite in layer order (the earliest
divergence first). An error is `case/mode: error — <its one-line cause, with the target's file:line>`.

A suite's rows carry their tolerance rule's reason at the end of their detail, in brackets (the
numerics suites' golden noise-floor paragraph, ~600 characters), and in their data (`rule`), where
it is read from. Printed once per row it buried the
lines; here each distinct rule of a suite is numbered and printed once, after the suite's lines,
and a line refers to it by number (`rule 1`). `parity review`, the terminal summary of a run and
the review page show the same lines (docs/reports.md §8).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from parity.compare import ERROR, FAIL
from parity.report.chains import localised_cases, repro_file, site_group
from parity.report.html import render
from parity.report.schema import row_data

LINE_CHARS = 200  # a line before its repro path (the reading budget: one screen line and a half)
_RELATION = {"higher": "≥ ", "lower": "≤ ", "equal": "= "}


def split_rule(detail: str, data: object = None) -> tuple[str, str]:
    """(the detail without its trailing rule paragraph, the paragraph or ''): the rule is the row's
    data (`rule`, written from `Verdict.rule`), never parsed back out of the detail."""
    detail = detail or ""
    rule = str(data.get("rule", "")) if isinstance(data, Mapping) else str(row_data(data).get("rule", ""))
    suffix = f" [{rule}]"
    if not rule or not detail.endswith(suffix):
        return detail, ""
    return detail.removesuffix(suffix), rule


def row_rule(row: Mapping[str, Any] | pd.Series) -> tuple[str, str]:
    """`split_rule` of a row: its detail and its data."""
    return split_rule(str(row["detail"]), row.get("data"))


def _number(value: float) -> str:
    return "nan" if value is None or pd.isna(value) else f"{value:.4g}"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


@dataclasses.dataclass(frozen=True)
class CaseLine:
    """One failing (suite, case, mode): where it diverges and the row that says it failed."""

    suite: str
    case: str
    mode: str
    where: str  # the blamed stage, "compiled piece X", "@site", or "error"
    row: pd.Series  # the case's first failing gate row in layer order
    rule: int | None  # the number of the row's rule in its suite (None: no rule paragraph)
    repro: str  # the repro's path relative to the run directory ('' when none)
    order: tuple[float, int]  # layer order: where it diverges, then the row's place in the run

    def text(self, run_dir: Path | None = None, limit: int = LINE_CHARS) -> str:
        """The line; the repro path after the first `limit` characters (absolute under `run_dir`)."""
        head = f"{self.case}/{self.mode}: "
        if self.row["verdict"] == ERROR:
            head += f"error — {self.row['metric']}: {row_rule(self.row)[0]}"
        else:
            relation = _RELATION.get(str(self.row.get("better", "")), "")
            bound = f"bound {relation}{_number(self.row['threshold'])}" if not pd.isna(self.row["threshold"]) else "no bound"
            bound += f", rule {self.rule}" if self.rule is not None else ""
            head += f"{self.where} — {self.row['metric']} {_number(self.row['value'])} ({bound})"
            short = row_rule(self.row)[0]
            if self.where.startswith("@") and short:  # not localised: the row's own words say what differs
                head += f": {short}"
        head = _cut(head.replace("\n", " | "), limit)
        if not self.repro:
            return head
        return f"{head} — {run_dir / self.repro if run_dir is not None else self.repro}"


def _site_order(site: str, chain_sites: list[str] | None = None) -> float:
    """Where a site is in the forward: its block's index (`layer.3.q_rope`, `layer.3`), before every
    block (a stage its chain lists before the first block: `embed`), or after them (`logits`)."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", site or "")
    if match:
        return float(match.group(1))
    if chain_sites and site in chain_sites:
        grouped = [i for i, s in enumerate(chain_sites) if site_group(s)]
        return -1.0 if grouped and chain_sites.index(site) < grouped[0] else math.inf
    return math.inf


@dataclasses.dataclass
class SuiteLines:
    """A suite's failing-case lines in layer order and its rules (numbered from 1)."""

    suite: str
    lines: list[CaseLine]
    rules: list[str]

    def rule_lines(self) -> list[str]:
        return [f"rule {i}: {rule}" for i, rule in enumerate(self.rules, start=1)]


def failing_case_lines(frame: pd.DataFrame) -> dict[str, SuiteLines]:
    """Per suite with a failing or erroring gate row: one line per failing (case, mode)."""
    gates = frame[(frame["kind"] != "info") & frame["verdict"].isin((FAIL, ERROR))]
    if gates.empty:
        return {}
    found = {item.key: item for item in localised_cases(frame)}
    out: dict[str, SuiteLines] = {}
    for (suite, case, mode), rows in gates.groupby(["suite", "case", "mode"], sort=False, dropna=False):
        suite_lines = out.setdefault(str(suite), SuiteLines(str(suite), [], []))
        rows = rows.sort_index(kind="stable")
        errors = rows[rows["verdict"] == ERROR]
        row = errors.iloc[0] if not errors.empty else rows.iloc[0]
        rule_text = row_rule(row)[1]
        rule = None
        if rule_text:
            if rule_text not in suite_lines.rules:
                suite_lines.rules.append(rule_text)
            rule = suite_lines.rules.index(rule_text) + 1
        where, repro, position = f"@{row['site']}" if row["site"] else "@(whole output)", "", _site_order(str(row["site"]))
        localised = found.get((str(suite), str(case), str(mode)))
        if localised is not None:
            blamed = [chain for chain in localised.chains if chain.blamed]
            pieces = [site for site in localised.pieces["site"] if site]
            if blamed:
                chain = blamed[0]
                sites = list(chain.stages["site"])
                where, repro, position = chain.blamed, chain.repro, _site_order(chain.blamed, sites)
            elif pieces:
                where = f"compiled piece {pieces[0]}"
            elif localised.chains:
                where += " (no one stage diverged)"
        suite_lines.lines.append(CaseLine(str(suite), str(case), str(mode), where, row, rule, repro, (position, int(row.name))))
    for suite_lines in out.values():
        suite_lines.lines.sort(key=lambda line: line.order)
    return out


def format_case_lines(suite_lines: SuiteLines, run_dir: Path | None = None, *, limit: int = 20, indent: str = "  ") -> list[str]:
    """A suite's lines (at most `limit`, then how many more) and its rules, once each."""
    lines = [indent + line.text(run_dir) for line in suite_lines.lines[:limit]]
    if len(suite_lines.lines) > limit:
        lines.append(f"{indent}... {len(suite_lines.lines) - limit} more failing cases (every row: results.csv)")
    return lines + [indent + text for text in suite_lines.rule_lines()]


def failing_cases_text(frame: pd.DataFrame, run_dir: Path | None = None, *, limit: int = 10) -> str:
    """The failing cases of a run, suite by suite, for the terminal after the summary table ('' when none)."""
    out = []
    for suite, suite_lines in failing_case_lines(frame).items():
        out.append(f"{suite}: {len(suite_lines.lines)} failing case(s)")
        out += format_case_lines(suite_lines, run_dir, limit=limit)
    return "\n".join(out)


def page_lines(frame: pd.DataFrame, run_dir: Path) -> list[dict[str, Any]]:
    """The review page's failing cases as data (the template `case_lines.html.j2` draws them): per
    suite its lines, each split around its rule's number (linked to the rule) with its repro
    (linked when the file is inside the run directory), and its rules with their anchors."""
    out = []
    for suite, suite_lines in failing_case_lines(frame).items():
        lines = []
        for line in suite_lines.lines:
            text = line.text(None)
            head = text.rsplit(" — ", 1)[0] if line.repro else text
            before, after, rule = head, "", None
            mark = f"rule {line.rule}"
            if line.rule is not None and mark in head:
                at = head.index(mark)
                before, after, rule = head[:at], head[at + len(mark) :], line.rule
            lines.append(
                {
                    "before": before,
                    "rule": rule,
                    "rule_anchor": rule_anchor(suite, rule) if rule is not None else "",
                    "after": after,
                    "repro": line.repro,
                    "linked": bool(line.repro) and repro_file(run_dir, line.repro) is not None,
                }
            )
        rules = [(rule_anchor(suite, i), rule) for i, rule in enumerate(suite_lines.rules, start=1)]
        out.append({"suite": suite, "count": len(suite_lines.lines), "lines": lines, "rules": rules})
    return out


def html_block(frame: pd.DataFrame, run_dir: Path) -> str:
    """The review page's failing cases (`page_lines`) as HTML."""
    return render("case_lines.html.j2", suites=page_lines(frame, run_dir))


def rule_anchor(suite: str, number: int) -> str:
    return "rule-" + re.sub(r"[^A-Za-z0-9_-]+", "-", suite) + f"-{number}"


def without_rules(rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` whose details end in a rule paragraph, the paragraph replaced by its suite's rule
    number (the numbering `failing_case_lines` gives, extended by rules only these rows hold)."""
    if rows.empty:
        return rows
    numbering = {suite: list(lines.rules) for suite, lines in failing_case_lines(rows).items()}

    def short(row: pd.Series) -> str:
        text, rule = row_rule(row)
        if not rule:
            return str(row["detail"])
        rules = numbering.setdefault(str(row["suite"]), [])
        if rule not in rules:
            rules.append(rule)
        return f"{text} [rule {rules.index(rule) + 1}]"

    return rows.assign(detail=rows.apply(short, axis=1))

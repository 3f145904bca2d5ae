"""A failing case's one-line verdict as soon as its test is judged, not only in the summary.

The process that ran the test (the session, or an xdist worker) turns the test's failing rows into
the lines of `parity.report.case_lines` (`case/mode: blamed stage — metric value (bound) — repro`)
and hands them over on the test's report (a user property: xdist sends it to the controller); the
process that owns the terminal prints them the moment the report arrives, prefixed with the suite
(docs/cli.md §11). The numbered tolerance rules are left out of these lines: their paragraphs are
printed once, in the summary at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from parity.report.case_lines import failing_case_lines
from parity.report.schema import COLUMNS

LINES_PROPERTY = "parity_case_lines"  # a test report's user property: its failing cases' lines


def case_lines(rows: Iterable[Mapping[str, Any]], run_dir: Path | None = None) -> list[str]:
    """`suite: case/mode: ...` for each failing case among `rows` (a test's rows, as written)."""
    records = [{column: "" if row.get(column) is None else str(row.get(column)) for column in COLUMNS} for row in rows]
    if not records:
        return []
    frame = pd.DataFrame(records, columns=list(COLUMNS))
    for column in ("value", "threshold"):
        frame[column] = pd.to_numeric(frame[column].replace("", "nan"), errors="coerce")
    out = []
    for suite, lines in failing_case_lines(frame).items():
        out += [f"{suite}: {dataclasses.replace(line, rule=None).text(run_dir)}" for line in lines.lines]
    return out


def attach(report: pytest.TestReport, lines: list[str]) -> None:
    """Hand `lines` to the process that prints them (the controller under xdist)."""
    if lines:  # a new list: pytest may share the item's own with the test's other reports
        report.user_properties = [*report.user_properties, (LINES_PROPERTY, lines)]


class LiveVerdicts:
    """Registered where the terminal is (the session, or xdist's controller): prints each failing
    case's line when its test's report arrives."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        lines: Any = dict(report.user_properties).get(LINES_PROPERTY)  # a list of str (`attach`)
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if not lines or terminal is None:
            return
        if self.config.pluginmanager.hasplugin("dsession"):  # xdist's progress letters: no line state to read
            terminal.write("\n")
        else:
            terminal.ensure_newline()
        for line in lines:
            terminal.write_line(f"FAILED {line}", red=True, bold=True)

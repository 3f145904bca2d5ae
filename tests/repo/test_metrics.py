"""One vocabulary of metrics (parity/compare/metrics.py): every metric a suite writes is in the table,
every direction a row carries is the table's where the table fixes one, and every metric the
review's readers name (the audit's decisions, the page's views) is a table name.

What a suite writes is read three ways: the names in the source (`metric="..."` and friends, an
f-string as a pattern), the committed baselines (every row the CPU and GPU lanes write) and the
session's lane run. Each check is shown going red on a table that lost an entry.
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from parity.compare import metrics
from parity.compare.metrics import BY_RULE, DECISION_METRICS, METRICS, base_name, lookup
from parity.report import audit, read_results
from parity.report.baseline import load_rows
from parity.report.views import VIEW_METRICS
from tests.support.helpers import PROJECT_ROOT
from tests.support.shared_run import SharedRun

BASELINES = sorted((PROJECT_ROOT / "reports" / "baselines").glob("*.csv"))
SOURCES = sorted(p for p in (PROJECT_ROOT / "parity").rglob("*.py"))


def _pattern(node: ast.JoinedStr) -> str:
    """An f-string metric name as a pattern: every formatted part a `*`."""
    return "".join(part.value if isinstance(part, ast.Constant) else "*" for part in node.values)


def _names(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.JoinedStr):
        yield _pattern(node)
    elif isinstance(node, (ast.List, ast.Tuple)):
        for element in node.elts:
            yield from _names(element)


def named_metrics(path: Path) -> Iterator[tuple[int, str]]:
    """(line, name) of every metric a module names: `metric=` and `metrics=` keywords, a row's
    `"metric": ...` entry, a `Verdict`'s metric (its second argument), a measured diff's
    `.verdict(name)` and `*_METRIC` constants."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "metric":
                    yield from ((node.lineno, name) for name in _names(value))
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute) and node.func.attr == "verdict" and node.args:
                yield from ((node.lineno, name) for name in _names(node.args[0]))
            for keyword in node.keywords:
                if keyword.arg in ("metric", "metrics"):
                    yield from ((node.lineno, name) for name in _names(keyword.value))
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if func == "Verdict" and len(node.args) >= 2:
                yield from ((node.lineno, name) for name in _names(node.args[1]))
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith("_METRIC") for t in node.targets):
            yield from ((node.lineno, name) for name in _names(node.value))


def unknown(names: set[str]) -> list[str]:
    """The names (or f-string patterns) no table entry stands for."""
    missing = []
    for name in sorted(names):
        if "*" in name:  # a pattern the suite writes: some entry's pattern must cover it
            if not any("*" in entry and fnmatch.fnmatchcase(name, entry) for entry in metrics.METRICS):
                missing.append(name)
        elif lookup(name) is None:
            missing.append(name)
    return missing


def source_names() -> set[str]:
    return {base_name(name) for path in SOURCES for _, name in named_metrics(path) if name}


def baseline_metrics() -> set[str]:
    return {base_name(str(m)) for path in BASELINES for m in load_rows(path)["metric"]}


def test_every_metric_the_suites_name_is_in_the_table() -> None:
    found = source_names()
    assert {"max_abs", "killed", "tokens", "*_ms", "first_diverging_stage"} <= found  # the scan sees them
    assert unknown(found) == []


def test_every_metric_of_the_committed_baselines_is_in_the_table() -> None:
    assert len(BASELINES) >= 2
    assert unknown(baseline_metrics()) == []


def test_every_metric_of_the_lane_run_is_in_the_table(lane_run: SharedRun) -> None:
    assert unknown({base_name(str(m)) for m in read_results(lane_run.run_dir)["metric"]}) == []


def directions_against_the_table(frame: pd.DataFrame) -> list[str]:
    """Rows whose `better` is not the table's for a metric the table gives one direction."""
    wrong = []
    for (metric, better), group in frame.groupby(["metric", "better"]):
        entry = lookup(str(metric))
        if entry is not None and entry.better != BY_RULE and better not in ("", entry.better):
            wrong.append(f"{metric}: {len(group)} rows say {better!r}, the table {entry.better!r}")
    return wrong


def test_the_rows_carry_the_tables_directions() -> None:
    for path in BASELINES:
        assert directions_against_the_table(load_rows(path)) == [], path.name


def test_the_readers_name_table_metrics() -> None:
    assert audit.DECISION_METRICS == DECISION_METRICS == ("matched_steps", "ids_mismatch")
    assert unknown({name for names in VIEW_METRICS.values() for name in names}) == []


@pytest.mark.parametrize("lost", ["psnr", "stage_rmse_vs_golden", "killed"])
def test_a_table_without_an_entry_goes_red(lost: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The switched-off variant: the table loses a metric the suites write."""
    monkeypatch.setattr(metrics, "METRICS", {name: entry for name, entry in METRICS.items() if name != lost})
    assert lost in unknown(source_names() | baseline_metrics())


def test_a_pattern_the_table_does_not_cover_goes_red(tmp_path: Path) -> None:
    planted = tmp_path / "suite.py"
    planted.write_text('report.info(metric=f"{label}_latency_us", value=1.0)\nVerdict(PASS, "made_up", 1, 1)\n')
    assert [name for _, name in named_metrics(planted)] == ["*_latency_us", "made_up"]
    planted.write_text('rows({"metric": "row_metric"})\nmeasured.verdict("verdict_metric")\n')
    assert sorted(name for _, name in named_metrics(planted)) == ["row_metric", "verdict_metric"]
    assert unknown({"*_latency_us", "made_up", "*_ms"}) == ["*_latency_us", "made_up"]


def test_a_direction_against_the_table_goes_red() -> None:
    rows = pd.DataFrame({"metric": ["psnr", "psnr", "compiles[f]"], "better": ["higher", "lower", "equal"]})
    assert directions_against_the_table(rows) == ["psnr: 1 rows say 'lower', the table 'higher'"]

"""Report rows: context filling, validation, concurrent appends, summaries, xdist and interruption."""

from __future__ import annotations

import math
import multiprocessing
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from parity.report import COLUMNS, ReportError, ReportWriter, case_verdicts, outcome, read_results, summarize
from tests.support.helpers import run_pytest

CONTEXT = {"run_id": "r1", "target": "serving", "device": "cpu", "dtype": "fp32", "size": "tiny"}


def _row(**overrides):
    row = {"suite": "numerics", "case": "mixed", "metric": "max_abs", "value": 1e-6, "threshold": 1e-5, "verdict": "pass"}
    row.update(overrides)
    return row


def test_rows_get_the_run_context_and_all_columns(tmp_path: Path) -> None:
    writer = ReportWriter(tmp_path, CONTEXT)
    writer.write(_row())
    writer.write(_row(case="und-only", verdict="fail", value=1.0, detail="layer 3, row 7"))
    frame = read_results(tmp_path)
    assert list(frame.columns) == list(COLUMNS)
    assert frame["run_id"].tolist() == ["r1", "r1"] and frame["mode"].tolist() == ["eager", "eager"]
    assert frame.loc[1, "detail"] == "layer 3, row 7" and frame.loc[1, "value"] == 1.0
    assert (tmp_path / "results.csv").read_text().count("run_id,") == 1


# Cells of every type the suites write: Python and numpy floats (shortest repr of their own
# precision), ints, bools, infinities, and text that needs quoting.
CELL_VALUES = [
    0.1, 1 / 3, 1e-8, 1e16, 1e22, -0.0, 5e-324, float("inf"), -float("inf"), float("nan"),
    np.float32(0.1), np.float32(1 / 3), np.float32(1e-8), np.float16(0.1), np.float64(0.1),
    np.int64(5), np.int32(-3), np.bool_(True), 7, True, 10**20, None, "", "a,b", 'say "x"', "two\nlines", "ünï",
]  # fmt: skip


def test_rows_are_the_text_pandas_writes_for_each_row(tmp_path: Path) -> None:
    """The writer formats cells itself (the csv module: a DataFrame per row cost about 2 ms); a row
    on its own must read as pandas' to_csv of the same normalised row writes it."""
    import io

    writer = ReportWriter(tmp_path, {"run_id": "r", "device": "cpu"})
    expected = io.StringIO()
    for index, value in enumerate(CELL_VALUES):
        row = writer.write({"suite": "s", "case": f"c{index}", "metric": "m", "verdict": "pass", "value": value, "detail": value})
        pd.DataFrame([row], columns=list(COLUMNS)).to_csv(expected, header=index == 0, index=False)
    assert (tmp_path / "results.csv").read_text() == expected.getvalue()
    assert len(read_results(tmp_path)) == len(CELL_VALUES)


def test_a_rows_bound_says_how_its_threshold_was_set(tmp_path: Path) -> None:
    writer = ReportWriter(tmp_path, CONTEXT)
    writer.write(_row())  # a threshold and no word on it: a policy
    writer.write(_row(case="measured", metric="rmse_vs_golden", bound="measured"))
    writer.write(_row(case="no-bound", metric="assertion", value=None, threshold=None))
    assert read_results(tmp_path)["bound"].tolist() == ["fixed", "measured", ""]


def test_results_without_a_column_are_refused_naming_it(tmp_path: Path) -> None:
    """A results file lacking a column (one written before `bound` existed) is not read with the
    column made up empty: one line names the file and the column."""
    ReportWriter(tmp_path, CONTEXT).write(_row())
    frame = pd.read_csv(tmp_path / "results.csv", dtype=str, keep_default_na=False).drop(columns="bound")
    frame.to_csv(tmp_path / "results.csv", index=False)
    with pytest.raises(ReportError, match=r"results\.csv: not a parity results file, missing columns \['bound'\]"):
        read_results(tmp_path)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"colour": "red"}, "unknown report columns"),
        ({"verdict": "ok"}, "verdict must be one of"),
        ({"kind": "x"}, "kind must be"),
        ({"case": ""}, "needs 'case'"),
        ({"bound": "guessed"}, "bound must be one of"),
    ],
)
def test_bad_rows_are_rejected_with_the_reason(tmp_path: Path, bad, message) -> None:
    with pytest.raises(ReportError, match=message):
        ReportWriter(tmp_path, CONTEXT).write(_row(**bad))


def _append(args):
    path, worker, count = args
    writer = ReportWriter(path, {**CONTEXT, "worker": worker})
    for i in range(count):
        writer.write(_row(case=f"{worker}-{i}", detail='comma, "quote"\nnewline'))


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_concurrent_processes_append_whole_rows_and_one_header(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_append, [(tmp_path, f"gw{i}", 40) for i in range(4)])
    frame = read_results(tmp_path)
    assert len(frame) == 160 and frame["case"].nunique() == 160
    assert set(frame["detail"]) == {'comma, "quote"\nnewline'}


def test_summary_counts_cases_by_their_worst_gate_row(tmp_path: Path) -> None:
    writer = ReportWriter(tmp_path, CONTEXT)
    writer.write_many(
        [
            _row(case="a"),
            _row(case="a", metric="cosine", verdict="fail", kind="info"),  # info rows decide nothing
            _row(case="b", verdict="fail", value=3e-5),
            _row(case="b"),
            _row(case="c", verdict="tie_flip"),
            _row(case="d", verdict="error", value=None),
            _row(suite="routing", case="e", metric="psnr", value=30.0, threshold=40.0, better="higher", verdict="fail"),
        ]
    )
    frame = read_results(tmp_path)
    verdicts = dict(zip(case_verdicts(frame)["case"], case_verdicts(frame)["verdict"]))
    assert verdicts == {"a": "pass", "b": "fail", "c": "tie_flip", "d": "error", "e": "fail"}
    summary = summarize(frame).set_index("suite")
    assert summary.loc["numerics", ["cases", "pass", "fail", "tie_flip", "error"]].tolist() == [4, 1, 1, 1, 1]
    assert "psnr=30" in summary.loc["routing", "worst"]
    assert outcome(tmp_path).failed_cases == 3
    assert "seconds" not in summary  # without run.json's suite_seconds: no column
    timed = summarize(frame, {"numerics": 1.25}).set_index("suite")
    assert timed.loc["numerics", "seconds"] == 1.2 and math.isnan(timed.loc["routing", "seconds"])


SUITE = textwrap.dedent(
    """
    import os, signal
    import pytest
    from parity.compare import Verdict

    pytestmark = pytest.mark.parity_suite("demo")

    @pytest.mark.parametrize("i", range(6))
    def test_rows(i, parity_report):
        parity_report.record(case=f"c{i}", metric="m", value=i, threshold=10)
        if i == int(os.environ.get("STOP_AT", "-1")):
            os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))

    def test_failing_check_writes_its_row_first(parity_report):
        parity_report.verdict(Verdict("fail", "max_abs", 0.5, 0.1, "layer 2"), case="bad")
        parity_report.verdict(Verdict("pass", "max_abs", 0.0, 0.1, "layer 3"), case="bad")

    def test_raising_check_becomes_an_error_row(parity_report):
        parity_report.case = "boom"
        raise RuntimeError("index 320 is out of bounds for dimension 0 with size 64")

    def test_bare_assert_becomes_a_fail_row(parity_report):
        parity_report.case = "plain"
        assert 1 == 2, "one is not two"
    """
)


@pytest.fixture
def demo_suite(tmp_path: Path) -> Path:
    (tmp_path / "test_demo.py").write_text(SUITE)
    return tmp_path


def _rows(report_dir: Path) -> pd.DataFrame:
    (run_dir,) = [p for p in report_dir.iterdir() if p.is_dir()]
    return read_results(run_dir)


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_failures_errors_and_asserts_all_reach_the_csv(demo_suite: Path, tmp_path: Path) -> None:
    out = tmp_path / "reports"
    result = run_pytest([str(demo_suite), "--parity-report-dir", str(out)], cwd=demo_suite)
    assert result.returncode == 1, result.stdout
    rows = _rows(out).set_index("case")
    assert rows.loc["bad", "verdict"].tolist() == ["fail", "pass"]
    assert rows.loc["boom", "verdict"] == "error" and "out of bounds" in rows.loc["boom", "detail"]
    assert rows.loc["plain", "verdict"] == "fail" and "one is not two" in rows.loc["plain", "detail"]
    assert "3 failed, 6 passed" in result.stdout


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGKILL"])
@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_an_interrupted_run_keeps_its_finished_rows(demo_suite: Path, tmp_path: Path, signal_name: str) -> None:
    out = tmp_path / "reports"
    result = run_pytest(
        [str(demo_suite), "--parity-report-dir", str(out), "-k", "test_rows"], cwd=demo_suite, STOP_AT="3", SIGNAL=signal_name
    )
    assert result.returncode != 0
    assert _rows(out)["case"].tolist() == ["c0", "c1", "c2", "c3"]


def _row_set(frame: pd.DataFrame) -> list[tuple]:
    keys = ["suite", "case", "mode", "metric", "value", "verdict", "kind"]
    return sorted(map(tuple, frame[keys].astype(str).values.tolist()))


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_xdist_workers_write_exactly_the_rows_of_a_serial_run(tmp_path: Path) -> None:
    runs = {}
    for workers in ("0", "2", "4"):
        out = tmp_path / f"n{workers}"
        result = run_pytest(
            ["parity/suites", "-m", "cpu", "--parity-suite", "selfcheck", "--parity-report-dir", str(out), "-n", workers]
        )
        assert result.returncode == 0, result.stdout + result.stderr
        runs[workers] = _rows(out)
    assert len(runs["0"]) > 10
    assert _row_set(runs["2"]) == _row_set(runs["0"])
    assert _row_set(runs["4"]) == _row_set(runs["0"])
    assert runs["2"]["worker"].str.startswith("gw").all()

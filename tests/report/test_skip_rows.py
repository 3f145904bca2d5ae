"""A skipped suite test leaves a `skip` row with pytest's reason; summaries, reviews and the page show it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pandas as pd
import pytest

from parity.compare import SKIP
from parity.report import read_results, summarize
from parity.report.baseline import baseline_rows
from parity.report.comparison import compare_rows
from tests.support.helpers import run_pytest

pytestmark = [pytest.mark.parity_cpu, pytest.mark.parity_slow]  # module fixtures run a session or compile: seconds

SKIPPING = textwrap.dedent(
    """
    import pytest

    pytestmark = pytest.mark.parity_suite("demo")

    @pytest.fixture
    def family():
        pytest.skip("target 'demo' provides no router (no router())")

    def test_runs(parity_report):
        parity_report.record(case="runs", metric="m", value=1.0, threshold=2.0)

    def test_skips_in_setup(family, parity_report):
        parity_report.record(case="never", metric="m", value=1.0)

    @pytest.mark.parametrize("mode", ["eager", "cuda_graph"])
    def test_skips_in_call(mode, parity_report):
        if mode == "cuda_graph":
            pytest.skip("cuda_graph needs --device cuda")
        parity_report.record(case="call", mode=mode, metric="m", value=1.0, threshold=2.0)

    def test_not_a_suite_test_is_left_alone():
        pass
    """
)


@pytest.fixture(scope="module")
def skipped_run(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    root = tmp_path_factory.mktemp("skips")
    (root / "test_skipping.py").write_text(SKIPPING)
    result = run_pytest([str(root), "-q", "--parity-report-dir", str(root / "out"), "--parity-run-id", "r"], cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    return read_results(root / "out" / "r")


def test_every_skipped_suite_test_has_a_skip_row_with_its_reason(skipped_run: pd.DataFrame) -> None:
    skips = skipped_run[skipped_run["verdict"] == SKIP].set_index("case")
    assert sorted(skips.index) == ["cuda_graph", "test_skips_in_setup"]
    assert skips.loc["test_skips_in_setup", "detail"] == "target 'demo' provides no router (no router())"
    assert skips.loc["cuda_graph", "detail"] == "cuda_graph needs --device cuda"
    assert skips.loc["cuda_graph", "mode"] == "cuda_graph"  # the parametrized mode, so a reader can filter by it
    assert (skips["metric"] == "skipped").all() and (skips["suite"] == "demo").all()
    assert (skips["kind"] == "info").all()  # a skip decided nothing: readers of gate rows see judged checks only


def test_the_summary_counts_skipped_tests_apart_from_passes(skipped_run: pd.DataFrame) -> None:
    (row,) = summarize(skipped_run).to_dict("records")
    assert (row["cases"], row["pass"], row["skip"], row["fail"]) == (4, 2, 2, 0)


def test_a_vanished_skip_row_is_not_a_lost_check(skipped_run: pd.DataFrame) -> None:
    """The baseline skipped a test that now runs: its skip row vanished, which is not a failure; a
    gate row that vanished still is."""
    baseline = baseline_rows(skipped_run)
    now_runs = skipped_run[skipped_run["verdict"] != SKIP]
    assert compare_rows(baseline, now_runs, name="b").ok
    lost = skipped_run[skipped_run["case"] != "runs"]
    comparison = compare_rows(baseline, lost, name="b")
    assert not comparison.ok and comparison.vanished_gate_rows == 1


def test_the_review_page_lists_skips_with_their_reasons(skipped_run: pd.DataFrame, tmp_path: Path) -> None:
    from parity.report.page import write_page
    from parity.report.review import load_review

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    skipped_run.to_csv(run_dir / "results.csv", index=False)
    page = write_page(load_review(run_dir, use_default_baseline=False)).read_text()
    assert 'id="skipped-rows"' in page and "cuda_graph needs --device cuda" in page

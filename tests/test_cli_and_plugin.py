"""`parity run` end to end, and the plugin's lanes, options and fixtures, in fresh processes."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from parity.report import COLUMNS, read_results
from tests.helpers import PROJECT_ROOT, run_parity, run_pytest


def _only_run_dir(report_dir: Path) -> Path:
    (run_dir,) = [p for p in report_dir.iterdir() if p.is_dir()]
    return run_dir


def test_run_help_documents_every_option() -> None:
    result = run_parity(["run", "--help"])
    assert result.returncode == 0
    for option in ("--device", "--size", "--dtype", "--target", "--report-dir", "--run-id", "--suite", "--numprocesses", "--benchmarks", "--seed"):
        assert option in result.stdout


def test_parity_run_writes_a_run_directory_and_a_summary(tmp_path: Path) -> None:
    result = run_parity(["run", "--suite", "selfcheck", "--report-dir", str(tmp_path), "--run-id", "first"])
    assert result.returncode == 0, result.stdout + result.stderr
    frame = read_results(tmp_path / "first")
    assert list(frame.columns) == list(COLUMNS) and (frame["verdict"] == "pass").all()
    assert "parity summary" in result.stdout and "selfcheck" in result.stdout
    assert str(tmp_path / "first" / "results.csv") in result.stdout
    assert (tmp_path / "first" / "run.json").exists()


def _copy_cases(tmp_path: Path) -> Path:
    cases = tmp_path / "cases"
    shutil.copytree(PROJECT_ROOT / "cases", cases)
    return cases


def test_a_failing_check_makes_parity_run_exit_non_zero(tmp_path: Path) -> None:
    cases = _copy_cases(tmp_path)
    text = (cases / "selfcheck.toml").read_text().replace("expected = -1.0", "expected = -0.5")
    (cases / "selfcheck.toml").write_text(text)
    result = run_parity(["run", "--suite", "selfcheck", "--report-dir", str(tmp_path / "out")], PARITY_CASES_DIR=str(cases))
    assert result.returncode == 1
    frame = read_results(_only_run_dir(tmp_path / "out"))
    assert frame.set_index("case").loc["cosine-opposite", "verdict"] == "fail"
    assert "1 case(s) failed" in result.stderr


def test_a_malformed_case_file_is_one_readable_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    cases = _copy_cases(tmp_path)
    text = (cases / "selfcheck.toml").read_text().replace("data_range = 255.0", 'data_range = "255"')
    (cases / "selfcheck.toml").write_text(text)
    result = run_parity(["run", "--suite", "selfcheck", "--report-dir", str(tmp_path / "out")], PARITY_CASES_DIR=str(cases))
    assert result.returncode != 0
    expected = "selfcheck.toml: table [psnr] case 'psnr-offset-uint8': key 'data_range': expected float, found str '255'"
    assert any(line.strip().endswith(expected) for line in result.stdout.splitlines()), result.stdout
    assert "Traceback" not in result.stdout


LANES = textwrap.dedent(
    """
    import pytest

    pytestmark = pytest.mark.suite("demo")

    def test_generic(report, settings, device):
        report.record(case="generic", metric="device", value=0, detail=str(device))

    @pytest.mark.gpu
    def test_needs_cuda():
        pass

    @pytest.mark.cpu
    def test_cpu_only():
        pass

    @pytest.mark.suite("other")
    def test_other_suite(report):
        report.record(case="x", metric="m", value=1)
    """
)


@pytest.fixture
def lanes(tmp_path: Path) -> Path:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["parity.plugin"]\n')
    (tmp_path / "test_lanes.py").write_text(LANES)
    return tmp_path


def test_cpu_lane_selects_everything_that_needs_no_gpu(lanes: Path) -> None:
    result = run_pytest([str(lanes), "-m", "cpu", "-q", "--report-dir", str(lanes / "out")], cwd=lanes)
    assert "3 passed, 1 deselected" in result.stdout, result.stdout


no_cuda = pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the behaviour on a machine without CUDA"
)


@no_cuda
def test_gpu_tests_skip_with_a_reason_without_cuda(lanes: Path) -> None:
    result = run_pytest([str(lanes), "-m", "gpu", "-rs", "--report-dir", str(lanes / "out")], cwd=lanes)
    assert "1 skipped" in result.stdout and "no CUDA device on this machine" in result.stdout, result.stdout


@no_cuda
def test_device_cuda_without_cuda_is_a_usage_error(lanes: Path) -> None:
    result = run_pytest([str(lanes), "--device", "cuda"], cwd=lanes)
    assert result.returncode == 4 and "--device cuda: no CUDA device" in result.stderr


def test_suite_option_selects_by_report_suite(lanes: Path) -> None:
    out = lanes / "out"
    result = run_pytest([str(lanes), "--suite", "other", "-q", "--report-dir", str(out), "--target", "reference"], cwd=lanes)
    assert "1 passed, 3 deselected" in result.stdout, result.stdout
    frame = read_results(_only_run_dir(out))
    assert frame["suite"].tolist() == ["other"] and frame["target"].tolist() == ["reference"]


def test_report_fixture_without_a_suite_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["parity.plugin"]\n')
    (tmp_path / "test_x.py").write_text("def test_x(report):\n    pass\n")
    result = run_pytest([str(tmp_path)], cwd=tmp_path)
    assert result.returncode != 0 and "declares no suite" in result.stdout


def test_a_plain_test_run_leaves_no_empty_run_directory(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["parity.plugin"]\n')
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    out = tmp_path / "out"
    assert run_pytest([str(tmp_path), "--report-dir", str(out)], cwd=tmp_path).returncode == 0
    assert not out.exists() or not any(out.iterdir())


def test_mutation_score_counts_killed_of_applicable_mutants_per_suite(tmp_path: Path) -> None:
    from parity.report import ReportWriter, mutation_score, read_results

    writer = ReportWriter(tmp_path, {"run_id": "r"})
    writer.write({"suite": "numerics", "case": "c", "metric": "max_abs", "value": 0.0, "verdict": "pass"})
    assert mutation_score(read_results(tmp_path)) is None
    for name, suite, verdict in (("a", "decode", "pass"), ("b", "decode", "fail"), ("c", "image", "pass"), ("d", "image", "not_applicable")):
        writer.write({"suite": "sensitivity", "case": name, "mode": suite, "metric": "killed", "value": int(verdict == "pass"), "verdict": verdict})
    writer.write({"suite": "sensitivity", "case": "correct-target-seed-1", "metric": "false_alarms", "value": 0, "verdict": "pass"})
    score = mutation_score(read_results(tmp_path))
    assert (score.killed, score.applicable, score.survivors, score.not_applicable) == (2, 3, ["b"], ["d"])
    assert score.per_suite == {"decode": (1, 2), "image": (1, 1)}
    assert score.line().startswith("mutation score: 2/3 applicable mutants killed on this lane (decode 1/2, image 1/1)")
    assert "not applicable here: d" in score.line() and "SURVIVED: b" in score.line()

"""A custom target's baseline is named by the `name` the target declares (run.json's
`target_provenance`), not by its `--target` value: renaming the adapter module keeps the baseline
(docs/reports.md "Migrating"). The built-in targets keep their file names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.report import RUN_INFO_FILE, write_run_info
from parity.report.baseline import default_baseline_path, write_baseline
from parity.report.review import format_review, load_review
from tests.report.test_baseline_targets import run_rows, write_run
from tests.support.helpers import run_pytest_in_pytester

PORTER = "my_engine.parity_target:make_target"
RENAMED = "my_engine.adapters.parity:make_target"
OLD_FILE = "cpu-fp32-my_engine.parity_target-make_target.csv"


def named_run(run_dir: Path, spec: str, name: str | None) -> Path:
    """A complete run of `spec` whose run.json records the name its target declares (None: a run of
    a parity that did not record it)."""
    write_run(run_dir, run_rows(spec))
    if name is not None:
        info = json.loads((run_dir / RUN_INFO_FILE).read_text())
        write_run_info(run_dir, {**info, "target_provenance": {"spec": spec, "name": name}})
    return run_dir


@pytest.mark.parametrize(
    "spec, name, expected",
    [
        ("serving", "serving", "cpu-fp32.csv"),
        ("reference", "reference", "cpu-fp32-reference.csv"),
        (PORTER, "myengine", "cpu-fp32-myengine.csv"),
        (RENAMED, "myengine", "cpu-fp32-myengine.csv"),
        (PORTER, "serving", "cpu-fp32-serving.csv"),  # a porter's name never lands on the built-in file
        (PORTER, None, OLD_FILE),  # run.json without a name: keyed by the --target value, as before
    ],
)
def test_the_baseline_file_is_named_by_the_declared_name(tmp_path: Path, spec: str, name: str | None, expected: str) -> None:
    run_dir = named_run(tmp_path / "run", spec, name)
    assert default_baseline_path(run_dir, run_rows(spec), tmp_path).name == expected


def test_a_renamed_adapter_module_keeps_its_baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The baseline was written from a run of `PORTER`; the adapter module moved (`RENAMED`), the
    target's name did not: the baseline is found and compares clean."""
    monkeypatch.chdir(tmp_path)
    baselines = tmp_path / "reports" / "baselines"
    write_baseline(run_rows(PORTER), baselines / "cpu-fp32-myengine.csv")
    run_dir = named_run(tmp_path / "reports" / "runs" / "r", RENAMED, "myengine")
    review = load_review(run_dir)
    assert review.comparison is not None and review.ok, format_review(review)
    assert review.comparison.vanished_gate_rows == 0 and review.comparison.regressions.empty
    assert f"--target {PORTER}" in review.baseline_migration and f"--target {RENAMED}" in review.baseline_migration
    assert review.baseline_migration in format_review(review)


def test_without_a_baseline_of_either_name_the_new_name_is_said(tmp_path: Path) -> None:
    run_dir = named_run(tmp_path / "run", PORTER, "myengine")
    review = load_review(run_dir, baseline_dir=tmp_path / "baselines")
    assert review.comparison is None and not review.baseline_migration
    assert str(tmp_path / "baselines" / "cpu-fp32-myengine.csv") in review.baseline_note


def test_a_session_records_the_target_name_in_run_json(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_named="""
        import pytest

        pytestmark = pytest.mark.parity_suite("demo")

        def test_row(parity_report):
            report = parity_report
            report.record(case="c", metric="m", value=0.0)
        """
    )
    out = pytester.path / "out"
    result = run_pytest_in_pytester(pytester, ["--parity-report-dir", str(out), "--parity-run-id", "r"])
    assert result.ret == 0, result.stdout.str()
    info = json.loads((out / "r" / RUN_INFO_FILE).read_text())
    assert info["target_provenance"]["name"] == "serving", info["target_provenance"]

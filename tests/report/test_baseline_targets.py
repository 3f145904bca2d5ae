"""Baselines are keyed by target as well as device and dtype, and `--write-baseline` never replaces a
baseline of another target or a more complete run without `--force`."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from parity.cli import main
from parity.report import COLUMNS, COMPLETE, ReportError, write_run_info
from parity.report.baseline import (
    BASELINE_COLUMNS,
    BaselineError,
    check_baseline_target,
    default_baseline_path,
    load_rows,
    write_baseline,
)
from parity.report.rundir import UnsafePathError

pytestmark = pytest.mark.parity_cpu

PORTER = "my_engine.parity_target:make_target"


def run_rows(target: str = "serving", cases: tuple[str, ...] = ("a", "b")) -> pd.DataFrame:
    rows = []
    for case in cases:
        row = dict.fromkeys(COLUMNS, "")
        row.update(
            run_id="r",
            suite="numerics",
            case=case,
            target=target,
            mode="eager",
            device="cpu",
            dtype="fp32",
            size="tiny",
            metric="max_abs",
            value=1e-7,
            threshold=1e-5,
            verdict="pass",
            kind="gate",
            better="lower",
            bound="fixed",
        )
        rows.append(row)
    return pd.DataFrame(rows, columns=list(COLUMNS))


def write_run(run_dir: Path, frame: pd.DataFrame) -> Path:
    """A complete run (run.json says so: a baseline is never written from an incomplete one)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    frame.to_csv(run_dir / "results.csv", index=False)
    write_run_info(run_dir, {"run_id": str(frame["run_id"].iloc[0]), "status": COMPLETE})  # as its rows say
    return run_dir


def test_the_default_baseline_path_carries_any_target_but_the_built_in_one(tmp_path: Path) -> None:
    assert default_baseline_path(tmp_path, run_rows(), tmp_path).name == "cpu-fp32.csv"
    porter = default_baseline_path(tmp_path, run_rows(PORTER), tmp_path)
    assert porter.name == "cpu-fp32-my_engine.parity_target-make_target.csv"


def test_a_baseline_of_another_target_is_never_overwritten_without_force(tmp_path: Path) -> None:
    committed = write_baseline(run_rows(), tmp_path / "cpu-fp32.csv")
    before = committed.read_text()
    with pytest.raises(BaselineError, match=r"made for device=cpu dtype=fp32 size=tiny target=serving.*--force"):
        write_baseline(run_rows(PORTER), committed)
    assert committed.read_text() == before
    write_baseline(run_rows(PORTER), committed, force=True)
    assert set(load_rows(committed)["target"]) == {PORTER}


def test_a_more_complete_baseline_is_never_overwritten_by_a_partial_run(tmp_path: Path) -> None:
    committed = write_baseline(run_rows(cases=("a", "b", "c")), tmp_path / "cpu-fp32.csv")
    with pytest.raises(BaselineError, match=r"holds 2 case\(s\) this run lacks.*numerics/b/serving/eager"):
        write_baseline(run_rows(cases=("a",)), committed)
    # A run with every case of the baseline (and more) may replace it.
    write_baseline(run_rows(cases=("a", "b", "c", "d")), committed)
    assert sorted(load_rows(committed)["case"]) == ["a", "b", "c", "d"]


def test_the_porters_write_baseline_lands_beside_the_committed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The reported accident: `parity review RUN --no-baseline --write-baseline` on a porter's partial
    run overwrote `reports/baselines/cpu-fp32.csv`. Now it writes the porter's own file, and naming the
    committed file explicitly is refused (exit 1) without --force."""
    monkeypatch.chdir(tmp_path)
    committed = write_baseline(run_rows(cases=("a", "b", "c")), tmp_path / "reports" / "baselines" / "cpu-fp32.csv")
    before = committed.read_text()
    run_dir = write_run(tmp_path / "reports" / "runs" / "porter", run_rows(PORTER, cases=("a",)))
    assert main(["review", str(run_dir), "--no-baseline", "--write-baseline"]) == 0
    assert committed.read_text() == before
    assert (committed.parent / "cpu-fp32-my_engine.parity_target-make_target.csv").is_file()
    capsys.readouterr()
    assert main(["review", str(run_dir), "--no-baseline", "--write-baseline", str(committed)]) == 1
    assert "refusing to overwrite the baseline" in capsys.readouterr().err
    assert committed.read_text() == before


def test_a_baseline_without_a_column_is_refused_naming_it(tmp_path: Path) -> None:
    """A baseline lacking a column (parity 0.4 wrote none of `tp` and `family`) is no baseline: a
    review names the file and the columns, and `--write-baseline` does not overwrite it, `--force`
    or not (regenerate it: remove the file first)."""
    path = write_baseline(run_rows(), tmp_path / "cpu-fp32.csv")
    pd.read_csv(path, keep_default_na=False).drop(columns=["tp", "family"]).to_csv(path, index=False)
    with pytest.raises(ReportError, match=r"cpu-fp32\.csv: not a parity results file, missing columns \['tp', 'family'\]"):
        load_rows(path, strict=True)
    with pytest.raises(UnsafePathError, match=r"exists and is not a parity baseline \(no column tp\)"):
        check_baseline_target(path)
    path.unlink()
    assert write_baseline(run_rows(), path).read_text().splitlines()[0].split(",") == list(BASELINE_COLUMNS)

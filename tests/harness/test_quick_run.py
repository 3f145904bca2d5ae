"""`parity run --quick` (docs/cli.md §11): its rows say they are a quick run, it keeps the lane's
modes and cases (cases/quick.toml), and a review never compares it with a full baseline as if it
were one: given one, it refuses with the reason; by default it looks for a quick baseline only.

One quick run of the numerics suite (seconds); the full baseline is the same rows marked as a
full run, which is what a full lane's baseline of these cases holds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from parity.plugin.quick import SUITES_DIR, QuickPlan, QuickPlanError, select
from parity.report import read_results
from parity.report.quick import is_quick, mismatch_note, quick_size
from tests.support.helpers import run_parity

pytestmark = [pytest.mark.parity_cpu, pytest.mark.parity_slow]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quick")
    done = run_parity(["run", "--quick", "--suite", "numerics", "--report-dir", str(root), "--run-id", "q"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root / "q"


def _as_full(run_dir: Path, path: Path) -> Path:
    """The run's rows marked as a full run's (`size` tiny): a full baseline of the same cases."""
    path.write_text((run_dir / "results.csv").read_text().replace(f",{quick_size('tiny')},", ",tiny,"))
    return path


def test_a_quick_run_says_so_and_keeps_the_lanes_cases(quick_run: Path) -> None:
    rows = read_results(quick_run / "results.csv")
    assert set(rows["size"]) == {"tiny-quick"}
    assert json.loads((quick_run / "run.json").read_text())["quick"] is True
    lane = QuickPlan.load().lane
    assert set(rows["mode"]) <= set(lane.modes)  # no Inductor-compiled mode
    kept = QuickPlan.load().runs["ar/test_numerics.py::test_target_matches_reference_layer_by_layer"].cases
    layer_rows = rows[rows["test"].str.contains("test_target_matches_reference_layer_by_layer")]
    assert set(layer_rows["case"]) == set(kept)


def test_a_review_refuses_a_full_baseline_for_a_quick_run(quick_run: Path, tmp_path: Path) -> None:
    full = _as_full(quick_run, tmp_path / "full.csv")
    done = run_parity(["review", str(quick_run), "--baseline", str(full)])
    assert done.returncode == 2, done.stdout[-2000:]
    assert "a quick run is compared only with a quick run or baseline" in done.stdout + done.stderr
    # the control: the same rows as a quick baseline are compared, and match
    done = run_parity(["review", str(quick_run), "--baseline", str(quick_run)])
    assert done.returncode == 0, done.stdout[-2000:]


def test_a_quick_runs_default_baseline_is_a_quick_one(quick_run: Path, tmp_path: Path) -> None:
    baselines = tmp_path / "reports" / "baselines"
    baselines.mkdir(parents=True)
    _as_full(quick_run, baselines / "cpu-fp32.csv")  # the full lane's default baseline, present
    done = run_parity(["review", str(quick_run)], cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-2000:]
    assert "cpu-fp32-quick.csv" in out and "compared only with a quick baseline" in out


def test_the_mismatch_note_names_both_directions_and_goes_quiet_for_like_runs() -> None:
    assert is_quick(quick_size("tiny")) and not is_quick("tiny")
    assert "this run is a quick run" in mismatch_note("tiny", "tiny-quick")
    assert "the baseline is a quick run" in mismatch_note("tiny-quick", "tiny")
    assert mismatch_note("tiny", "tiny") == mismatch_note("tiny-quick", "tiny-quick") == ""


def _item(test: str, case: str, mode: str) -> SimpleNamespace:
    """What the quick lane reads of a collected suite test (`parity.plugin.quick.decide`)."""
    file, function = test.split("::")
    callspec = SimpleNamespace(id=f"{mode}-{case}", params={"mode": mode})
    return SimpleNamespace(path=SUITES_DIR / file, originalname=function, name=f"{function}[{callspec.id}]", callspec=callspec)


def test_a_run_entry_that_keeps_none_of_its_cases_stops_the_session() -> None:
    """A renamed case must not drop its test out of the quick lane unseen."""
    plan = QuickPlan.load()
    test = "ar/test_numerics.py::test_first_differing_row_is_the_first_gen_token"
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: None))
    items = [_item(test, "mixed", "eager"), _item(test, "mixed", "compiled")]
    kept = list(items)
    select(config, kept, plan)
    assert [i.callspec.id for i in kept] == ["eager-mixed"]
    renamed = dataclasses.replace(plan, runs={**plan.runs, test: dataclasses.replace(plan.runs[test], cases=["renamed"])})
    with pytest.raises(QuickPlanError, match="keeps none of its cases"):
        select(config, list(items), renamed)


def test_a_case_directory_naming_a_lane_test_again_is_refused_in_one_line(tmp_path: Path) -> None:
    cases = tmp_path / "cases"
    cases.mkdir()
    test = "ar/test_numerics.py::test_first_differing_row_is_the_first_gen_token"
    (cases / "quick.toml").write_text(f'[[run]]\ntest = "{test}"\ncases = ["renamed"]\nreason = "r"\n')
    done = run_parity(["run", "--quick", "--suite", "numerics", "--cases", str(cases), "--report-dir", str(tmp_path)])
    errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("ERROR")]
    assert done.returncode == 4 and errors == [
        f"ERROR: cases/quick.toml: {test} is named more than once ([[run]] or [[leave_out]])"
    ]


def test_the_quick_lane_generates_no_code(tmp_path: Path) -> None:
    """No Inductor code generation: the lane's compiles (embedding_clamp's compiled lookup and
    one-frame check) leave an empty Inductor cache directory, which the full lane's fill."""

    def inductor_files(*quick: str) -> list[Path]:
        cache = tmp_path / f"inductor{len(quick)}"
        cache.mkdir()
        done = run_parity(
            ["run", *quick, "--suite", "embedding_clamp", "--report-dir", str(tmp_path), "--run-id", f"r{len(quick)}"],
            TORCHINDUCTOR_CACHE_DIR=str(cache),
        )
        assert done.returncode == 0, done.stdout[-2000:]
        return [path for path in cache.rglob("*") if path.is_file()]

    assert inductor_files("--quick") == []
    assert inductor_files() != []  # the control: the full lane's compiled modes generate code there

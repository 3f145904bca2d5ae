"""The mutant catalogue per lane: every entry says how it dies on the CPU and on the CUDA lane,
graph-mode selections name that lane's graph mode, and an entry that cannot apply on a lane is
recorded `not_applicable` with its reason, never as a pass and never as killed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from parity.report import mutation_score, read_results
from parity.suites.sensitivity import catalogue
from parity.suites.sensitivity.catalogue import LANES, NotApplicable, all_mutants
from tests.support.helpers import PROJECT_ROOT, run_command, run_pytest, subprocess_env

OTHER_LANE_GRAPH_MODE = {"cpu": "cuda_graph", "cuda": "cpu_graph"}


CATALOGUE = all_mutants()


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_every_mutant_declares_every_lane(name: str) -> None:
    mutant = CATALOGUE[name]
    assert set(mutant.lanes) == set(LANES), f"{name}: lanes {sorted(mutant.lanes)}"
    for lane in LANES:
        kill = mutant.on(lane)
        if isinstance(kill, NotApplicable):
            assert kill.reason.strip(), f"{name}: not applicable on {lane} without a reason"
            continue
        assert kill.tests and kill.size in ("tiny", "full"), (name, lane, kill)
        text = " ".join(kill.tests)
        # A CPU-lane selection of cuda_graph tests (or the reverse) selects tests that skip on that
        # lane: the mutant would survive there for want of a test (the three GPU-lane survivors of
        # the host-branch, replay-without-copy-in, moe ranges).
        assert OTHER_LANE_GRAPH_MODE[lane] not in text, f"{name} on {lane}: selects {text!r}"


def test_the_stale_replay_mutant_breaks_both_graph_runners() -> None:
    from parity.runners.cpu_graph import CpuGraphRun
    from parity.runners.cuda_graph import CudaGraphRun
    from parity.runners.graph import GraphRun

    before = GraphRun._copy_in
    try:
        catalogue._APPLY["replay-without-copy-in"]()
        assert CpuGraphRun._copy_in is not before and CudaGraphRun._copy_in is not before
    finally:
        GraphRun._copy_in = before


FAKE_ENTRY = """
from parity.suites.sensitivity import catalogue

def pytest_configure(config):
    catalogue.CATALOGUE["fake-equivalent"] = catalogue.Mutant(
        "fake-equivalent", "an equivalent mutant for the test", "numerics", "serving",
        {"cpu": catalogue.NotApplicable("equivalent at fp32 by construction"),
         "cuda": catalogue.NotApplicable("equivalent at bf16 by construction")},
    )
"""


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_a_mutant_that_cannot_apply_is_recorded_not_applicable(tmp_path: Path) -> None:
    (tmp_path / "fake_entry.py").write_text(FAKE_ENTRY)
    result = run_pytest(
        [
            "parity/suites/sensitivity/test_sensitivity.py",
            "-k",
            "test_mutant_is_killed and fake-equivalent",
            "-p",
            "fake_entry",
            "--parity-report-dir",
            str(tmp_path),
            "--parity-run-id",
            "na",
        ],
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(PROJECT_ROOT)]),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_results(tmp_path / "na")
    (row,) = rows.itertuples()
    assert row.verdict == "not_applicable" and "equivalent at fp32 by construction" in row.detail
    score = mutation_score(rows)
    assert (score.killed, score.applicable, score.not_applicable, score.survivors) == (0, 0, ["fake-equivalent"], [])


SAME_NAME_MODULE = "def test_compiled():\n    pass\n\n\ndef test_eager():\n    pass\n"


def _collected(tmp_path: Path, *args: str) -> set[str]:
    import sys

    result = run_command(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:parity", *args],
        cwd=tmp_path,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return {line for line in result.stdout.splitlines() if "::" in line}


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_control_selections_apply_each_expression_to_its_own_file(tmp_path: Path) -> None:
    """Two suites' modules share a name (ar/ and dit/test_numerics.py): a control built as one `-k`
    of module-qualified terms selects the other module's tests too (the broken variant, first);
    the selection plugin keeps exactly what each mutant's own selection picks."""
    for package in ("ar", "dit"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "test_numerics.py").write_text(SAME_NAME_MODULE)
    files = ["ar/test_numerics.py", "dit/test_numerics.py"]
    union = _collected(tmp_path, *files, "-k", "(test_numerics and (eager)) or (test_numerics and (compiled))")
    assert len(union) == 4  # ar's compiled test and dit's eager test were never asked for
    selections = json.dumps([["ar/test_numerics.py", "eager"], ["dit/test_numerics.py", "compiled"]])
    exact = _collected(tmp_path, *files, "-p", "parity.suites.sensitivity.selection", "--kill-selections", selections)
    assert exact == {"ar/test_numerics.py::test_eager", "dit/test_numerics.py::test_compiled"}


# The gate metrics of counts decided by code paths: what the seed-independent selections may gate
# on for the later control seeds to leave them out (parity/suites/sensitivity/runs.py, SEED_INDEPENDENT).
COUNT_METRICS = {
    "new_compiles",
    "graph_breaks",
    "eager_fallback",
    "regional_modules_compiled",
    "control_frame_compiles",
    "missing_probe_warnings",
}


def _control_pairs(lane: str, seed: int, *, covered: bool = False) -> set[tuple[str, str | None]]:
    from parity.suites.sensitivity.runs import control_selections

    pairs = set()
    for selection in control_selections(lane, seed, covered=covered).values():
        pairs |= {tuple(pair) for pair in json.loads(selection[selection.index("--kill-selections") + 1])}
    return pairs


@pytest.mark.parametrize("lane", LANES)
def test_later_control_seeds_leave_out_only_the_seed_independent_selections(lane: str) -> None:
    from parity.suites.sensitivity.runs import CONTROL_SEEDS, SEED_INDEPENDENT

    first = _control_pairs(lane, CONTROL_SEEDS[0])
    independent = {pair for pair in first if pair in SEED_INDEPENDENT or (pair[0], None) in SEED_INDEPENDENT}
    assert {file for file, _ in independent} >= {file for file, _ in SEED_INDEPENDENT if file in {f for f, _ in first}}
    assert independent, "the first seed runs the seed-independent selections"
    for seed in CONTROL_SEEDS[1:]:
        assert _control_pairs(lane, seed) == first - independent, seed


@pytest.mark.parametrize("lane", LANES)
def test_a_run_that_runs_the_seed_independent_selections_itself_leaves_them_out_of_every_control(lane: str) -> None:
    from parity.suites.sensitivity.runs import CONTROL_SEEDS

    later = _control_pairs(lane, CONTROL_SEEDS[-1])
    for seed in CONTROL_SEEDS:
        assert _control_pairs(lane, seed, covered=True) == later, seed


SUITE_STUB = "def test_missing_probe_warning_fires_exactly_once():\n    pass\n\ndef test_capture_without_mask():\n    pass\n"


@pytest.mark.parametrize(
    ("dtype", "target", "files", "covered"),
    [
        ("fp32", "serving", ("ar/test_recompiles.py", "dit/test_recompiles.py", "ar/test_fail_closed_capture.py"), True),
        ("fp32", "serving", ("ar/test_recompiles.py", "ar/test_fail_closed_capture.py"), False),  # a file deselected
        ("fp32", "serving", ("ar/test_recompiles.py", "dit/test_recompiles.py"), False),  # the probe test deselected
        ("bf16", "serving", ("ar/test_recompiles.py", "dit/test_recompiles.py", "ar/test_fail_closed_capture.py"), False),
        ("fp32", "reference", ("ar/test_recompiles.py", "dit/test_recompiles.py", "ar/test_fail_closed_capture.py"), False),
    ],
)
def test_a_run_covers_the_seed_independent_selections_only_at_the_kill_configuration(
    pytester, dtype, target, files, covered
) -> None:
    """The controls leave the seed-independent selections out only when this run runs every one of
    them on the correct target at the configuration the lane's mutants are killed at (a bf16 CPU
    run, a `--suite` run without one of them, or another target is no control of them)."""
    from parity.suites.sensitivity.runs import run_covers_seed_independent

    paths = []
    for file in files:
        path = pytester.path / "parity" / "suites" / file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(SUITE_STUB)
        paths.append(path)
    items, _ = pytester.inline_genitems(*paths, "-p", "no:parity", "--import-mode=importlib")
    settings = SimpleNamespace(device="cpu", dtype=dtype, size="tiny", target=target, tp=1)
    assert run_covers_seed_independent(items, settings, root=pytester.path) is covered


def test_sessions_are_batched_by_cost_with_the_controls_last() -> None:
    from parity.suites.sensitivity.catalogue import Kill
    from parity.suites.sensitivity.runs import Session, balanced_batches

    def session(kind: str, name: str, cost: float) -> Session:
        return Session((kind, name), [], Kill(()), Path(name), cost)

    sessions = [session("control", f"c{i}", 40.0) for i in range(3)] + [session("mutant", f"m{i}", 1.0) for i in range(20)]
    sessions.append(session("mutant", "compiling", 15.0))
    batches = balanced_batches(sessions, 4)
    assert sorted(s.key for batch in batches for s in batch) == sorted(s.key for s in sessions)
    loads = [sum(s.cost for s in batch) for batch in batches]
    assert max(loads) - min(loads) <= 40.0  # no batch waits on more than one control beyond another
    for batch in batches:
        kinds = [s.is_control for s in batch]
        assert kinds == sorted(kinds), "a batch runs its controls after its mutants"


def test_the_seed_independent_selections_gate_only_on_counts() -> None:
    """The premise of leaving them out: every gate row those selections wrote in the committed CPU
    baseline is a count decided by code paths. A value-dependent gate added to them fails here."""
    import pandas as pd

    baseline = pd.read_csv(PROJECT_ROOT / "reports" / "baselines" / "cpu-fp32.csv")
    gates = baseline[baseline["kind"] == "gate"]
    recompiles = gates[gates["suite"] == "recompiles"]
    probe = gates[(gates["suite"] == "fail_closed_capture") & gates["case"].str.startswith("missing-probe")]
    assert not recompiles.empty and not probe.empty
    metrics = set(recompiles["metric"]) | set(probe["metric"])
    assert metrics <= COUNT_METRICS, sorted(metrics - COUNT_METRICS)

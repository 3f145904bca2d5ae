"""sensitivity: every suite can fail. Each known-bad target of the catalogue must be killed.

For every mutant of `suites/mutants.py` the suite runs the tests of the suite named for it against
the mutant (`--target <mutant factory>`, a fresh pytest process, so a monkeypatch cannot leak) and
records whether a gate row of that suite failed, with the row that killed it. A survivor is a gap
in a suite and fails here. The correct target must raise no alarm on the same tests under three
other seeds (no false alarms). Seed-002's lesson: emptying `_repeated_blocks` passed all four
tests of the original compile-parity suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from parity.compare import FAIL, PASS, Verdict
from parity.env import PROJECT_ROOT
from parity.report import read_results
from suites.mutants import CATALOGUE

pytestmark = [pytest.mark.suite("sensitivity"), pytest.mark.slow]

CONTROL_SEEDS = (1, 2, 3)


def _child(args: list[str], out: Path, settings) -> tuple[int, pd.DataFrame | None, str]:
    """pytest in a fresh process (a mutant's monkeypatches stay there); its rows go under `out`."""
    argv = [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "--report-dir", str(out), "--run-id", "child",
            "--device", settings.device, "--size", settings.size, "--no-parity-summary", "-q"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run(argv, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=900)
    results = out / "child" / "results.csv"
    rows = read_results(results.parent) if results.exists() else None
    tail = (done.stdout.strip().splitlines() or [""])[-1] + " " + done.stderr[-400:]
    return done.returncode, rows, tail.strip()


def _failing(rows: pd.DataFrame | None, suite: str | None = None) -> pd.DataFrame:
    if rows is None:
        return pd.DataFrame()
    gates = rows[(rows["kind"] == "gate") & rows["verdict"].isin(["fail", "error"])]
    return gates if suite is None else gates[gates["suite"] == suite]


@pytest.fixture(autouse=True)
def _built_in_target_only(settings) -> None:
    if settings.target != "serving":
        pytest.skip(f"the catalogue mutates the built-in serving target, not {settings.target!r}")


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_mutant_is_killed(name: str, report, settings, tmp_path: Path) -> None:
    mutant = CATALOGUE[name]
    code, rows, tail = _child([*mutant.tests, "--target", mutant.target, "-x"], tmp_path, settings)
    killers = _failing(rows, mutant.suite)
    killed = code != 0 and not killers.empty
    if killed:
        first = killers.iloc[0]
        detail = f"killed by {first['suite']}/{first['case']}/{first['mode']} {first['metric']}={first['value']}: {str(first['detail'])[:300]}"
    else:
        detail = f"SURVIVED: exit {code}, no failing {mutant.suite} row ({tail[:300]})"
    report.verdict(Verdict(PASS if killed else FAIL, "killed", int(killed), 1, f"{mutant.defect} || {detail}"),
                   case=name, mode=mutant.suite, better="equal")


def _control_selection() -> list[str]:
    """Every test a mutant is checked with, as one pytest selection (files plus an OR of -k terms)."""
    files, terms = [], []
    for mutant in CATALOGUE.values():
        path, *rest = mutant.tests
        module = Path(path).stem
        files.append(path)
        expression = rest[rest.index("-k") + 1] if "-k" in rest else None
        terms.append(f"({module} and ({expression}))" if expression else f"({module})")
    return [*dict.fromkeys(files), "-k", " or ".join(dict.fromkeys(terms))]


@pytest.mark.parametrize("seed", CONTROL_SEEDS)
def test_correct_target_raises_no_alarm(seed: int, report, settings, tmp_path: Path) -> None:
    code, rows, tail = _child([*_control_selection(), "--target", "serving", "--seed", str(seed)], tmp_path, settings)
    alarms = _failing(rows)
    cases = 0 if rows is None else rows[["suite", "case", "mode"]].drop_duplicates().shape[0]
    ok = code == 0 and alarms.empty and rows is not None
    detail = (
        f"{cases} cases of the catalogue's tests on the correct target with --seed {seed}: "
        + ("no alarm" if ok else f"exit {code}; " + "; ".join(f"{r.suite}/{r.case}/{r.mode} {r.metric}={r.value}" for r in alarms.head(5).itertuples()) + f" {tail[:200]}")
    )
    report.verdict(Verdict(PASS if ok else FAIL, "false_alarms", len(alarms), 0, detail), case=f"correct-target-seed-{seed}", mode="all")

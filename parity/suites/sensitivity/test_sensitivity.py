"""sensitivity: every suite can fail. Each known-bad target of the catalogue must be killed.

For every mutant of `parity/suites/ar/mutants.py` the suite runs, against the mutant, the tests that its
catalogue entry selects for this run's lane (`cpu` or `cuda`, at the entry's size and dtype), in
an isolated pytest session (a child forked from a pre-imported server, so a monkeypatch cannot
leak), and records whether a gate row of the mutant's suite failed, with the row that killed it.
A survivor is a gap in a suite and fails here. A mutant that cannot show on this lane (an
equivalent mutant at that configuration) is recorded `not_applicable` with its reason: never a
pass, and not counted as applicable. The correct target must raise no alarm on the same
selections under three other seeds (no false alarms). vllm-project/vllm-omni#7455's lesson: emptying
`_repeated_blocks` passed all four tests of the original compile-parity suite.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from parity.compare import NOT_APPLICABLE, Verdict, flag_rule
from parity.env import PROJECT_ROOT
from parity.report import read_results
from parity.suites.sensitivity.catalogue import Kill, NotApplicable, all_mutants, lane_of
from parity.suites.sensitivity.sessions import DEFAULT_PRELOAD, PytestForkServer

pytestmark = [pytest.mark.suite("sensitivity"), pytest.mark.slow]

CATALOGUE = all_mutants()
CONTROL_SEEDS = (1, 2, 3)
CHILD_TIMEOUT_S = 900
# The suites' own modules as well: each child then starts with its collection imports done.
PRELOAD = (*DEFAULT_PRELOAD, "parity.suites.conftest", "parity.suites.sensitivity.catalogue")


@pytest.fixture(scope="module")
def sessions() -> Iterator[PytestForkServer]:
    """One pre-imported server for this module's isolated pytest sessions."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
    with PytestForkServer(cwd=PROJECT_ROOT, env=env, preload=PRELOAD) as server:
        yield server


def _child(sessions: PytestForkServer, args: list[str], kill: Kill, out: Path, settings) -> tuple[int, pd.DataFrame | None, str]:
    """An isolated pytest session at the selection's configuration; its rows go under `out`."""
    argv = [
        *args,
        "-p",
        "no:cacheprovider",
        "--parity-report-dir",
        str(out),
        "--parity-run-id",
        "child",
        "--parity-device",
        settings.device,
        "--parity-size",
        kill.size,
        "--parity-no-summary",
        "-q",
    ]
    if kill.dtype:
        argv += ["--parity-dtype", kill.dtype]
    log = out / "child.log"
    code = sessions.run(argv, log, timeout=CHILD_TIMEOUT_S)
    results = out / "child" / "results.csv"
    rows = read_results(results.parent) if results.exists() else None
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    tail = " | ".join(lines[-3:])
    return code, rows, tail


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
def test_mutant_is_killed(name: str, report, settings, sessions, tmp_path: Path) -> None:
    mutant = CATALOGUE[name]
    lane = lane_of(settings.device)
    kill = mutant.on(lane)
    if isinstance(kill, NotApplicable):
        report.verdict(
            Verdict(NOT_APPLICABLE, "killed", None, None, f"{mutant.defect} || not applicable on the {lane} lane: {kill.reason}"),
            case=name,
            mode=mutant.suite,
            better="equal",
        )
        return
    code, rows, tail = _child(sessions, [*kill.tests, "--parity-target", mutant.target, "-x"], kill, tmp_path, settings)
    killers = _failing(rows, mutant.suite)
    killed = code != 0 and not killers.empty
    where = f"{lane} lane, {kill.size}" + (f" {kill.dtype}" if kill.dtype else "")
    if killed:
        first = killers.iloc[0]
        detail = (
            f"killed on the {where} by {first['suite']}/{first['case']}/{first['mode']} "
            f"{first['metric']}={first['value']}: {str(first['detail'])[:300]}"
        )
    else:
        detail = f"SURVIVED on the {where}: exit {code}, no failing {mutant.suite} row ({tail[:300]})"
    if kill.why:
        detail += f" [{kill.why}]"
    report.verdict(
        flag_rule(killed, metric="killed", detail=f"{mutant.defect} || {detail}"), case=name, mode=mutant.suite, better="equal"
    )


def control_selections(lane: str) -> dict[Kill, list[str]]:
    """Every test the lane's mutants are checked with, one pytest selection per configuration
    (size, dtype): the files, and each mutant's `-k` applied to its own file only
    (`parity/suites/sensitivity/selection.py`)."""
    groups: dict[tuple[str, str | None], tuple[list[str], list[tuple[str, str | None]]]] = {}
    for mutant in CATALOGUE.values():
        kill = mutant.on(lane)
        if isinstance(kill, NotApplicable):
            continue
        files, selections = groups.setdefault(kill.config, ([], []))
        path, *rest = kill.tests
        files.append(path)
        expression = rest[rest.index("-k") + 1] if "-k" in rest else None
        if (path, expression) not in selections:
            selections.append((path, expression))
    return {
        Kill((), size=size, dtype=dtype): [
            *dict.fromkeys(files),
            "-p",
            "parity.suites.sensitivity.selection",
            "--kill-selections",
            json.dumps(selections),
        ]
        for (size, dtype), (files, selections) in groups.items()
    }


@pytest.mark.parametrize("seed", CONTROL_SEEDS)
def test_correct_target_raises_no_alarm(seed: int, report, settings, sessions, tmp_path: Path) -> None:
    lane = lane_of(settings.device)
    alarms, cases, exits, tails = [], 0, [], []
    for index, (config, selection) in enumerate(control_selections(lane).items()):
        out = tmp_path / f"config-{index}"
        out.mkdir()
        code, rows, tail = _child(
            sessions, [*selection, "--parity-target", "serving", "--parity-seed", str(seed)], config, out, settings
        )
        exits.append(code)
        if rows is None:
            tails.append(f"{config.size}/{config.dtype or 'lane dtype'}: no rows ({tail[:200]})")
            continue
        alarms.append(_failing(rows))
        cases += rows[["suite", "case", "mode"]].drop_duplicates().shape[0]
    found = pd.concat(alarms) if alarms else pd.DataFrame()
    ok = all(code == 0 for code in exits) and found.empty and not tails
    detail = f"{cases} cases of the {lane} lane's catalogue tests on the correct target with --seed {seed}: " + (
        "no alarm"
        if ok
        else f"exits {exits}; "
        + "; ".join(f"{r.suite}/{r.case}/{r.mode} {r.metric}={r.value}" for r in found.head(5).itertuples())
        + " "
        + " ".join(tails)
    )
    # no alarm row, and every child exited cleanly with rows: the flag decides, the row counts the alarms
    report.verdict(
        flag_rule(ok, metric="false_alarms", value=len(found), threshold=0, detail=detail),
        case=f"correct-target-seed-{seed}",
        mode="all",
    )

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
from typing import Any

import pandas as pd
import pytest

from parity.compare import NOT_APPLICABLE, Verdict, flag_rule
from parity.env import PROJECT_ROOT
from parity.plugin.options import plugin_load_args
from parity.report import read_results
from parity.suites.sensitivity.catalogue import Kill, NotApplicable, all_mutants, lane_of
from parity.suites.sensitivity.sessions import DEFAULT_PRELOAD, PytestForkServer

pytestmark = [pytest.mark.suite("sensitivity"), pytest.mark.slow]

CATALOGUE = all_mutants()
CONTROL_SEEDS = (1, 2, 3)
CHILD_TIMEOUT_S = 900
# The suites' own modules as well: each child then starts with its collection imports done.
PRELOAD = (*DEFAULT_PRELOAD, "parity.suites.conftest", "parity.suites.sensitivity.catalogue")


def parallel_sessions() -> int:
    """How many child sessions to keep running at once: the cores this process may use, when it
    is the only test process (a serial run); one per xdist worker, whose siblings use the others.
    PARITY_SENSITIVITY_JOBS overrides it."""
    override = os.environ.get("PARITY_SENSITIVITY_JOBS")
    if override:
        return max(1, int(override))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), 4))


class ChildSessions:
    """The module's isolated pytest sessions, on one pre-imported fork server. With cores to spare
    every selected test's sessions are started up front (the controls, the longest, first) and each
    test collects its own; otherwise each test runs its sessions when it runs."""

    def __init__(self, server: PytestForkServer, settings, parallel: int) -> None:
        self.server, self.settings, self.parallel = server, settings, parallel
        self.started: dict[tuple, tuple[Any, Path]] = {}

    def argv(self, args: list[str], kill: Kill, out: Path) -> list[str]:
        argv = [
            *plugin_load_args(),  # a checkout run without installing (the GPU box) has no entry point
            *args,
            "-p",
            "no:cacheprovider",
            "--parity-report-dir",
            str(out),
            "--parity-run-id",
            "child",
            "--parity-device",
            self.settings.device,
            "--parity-size",
            kill.size,
            "--parity-no-summary",
            "-q",
        ]
        return argv + (["--parity-dtype", kill.dtype] if kill.dtype else [])

    def start(self, key: tuple, args: list[str], kill: Kill, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        future = self.server.submit(self.argv(args, kill, out), out / "child.log", timeout=CHILD_TIMEOUT_S)
        self.started[key] = (future, out)

    def result(self, key: tuple, args: list[str], kill: Kill, out: Path) -> tuple[int, pd.DataFrame | None, str]:
        """The session's exit code, its rows and the tail of its log (started now if it was not)."""
        if key not in self.started:
            self.start(key, args, kill, out)
        future, out = self.started.pop(key)
        code = future.result()
        results = out / "child" / "results.csv"
        rows = read_results(results.parent) if results.exists() else None
        log = out / "child.log"
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        return code, rows, " | ".join(lines[-3:])


@pytest.fixture(scope="module")
def sessions(request: pytest.FixtureRequest, settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChildSessions]:
    """One pre-imported server for this module's isolated pytest sessions."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
    with PytestForkServer(cwd=PROJECT_ROOT, env=env, preload=PRELOAD) as server:
        children = ChildSessions(server, settings, parallel_sessions())
        if children.parallel > 1 and settings.target == "serving":
            _start_selected(children, request, tmp_path_factory)
        yield children


def _start_selected(children: ChildSessions, request: pytest.FixtureRequest, tmp_path_factory) -> None:
    """Start the sessions of every test of this module the run selected, longest first."""
    lane = lane_of(children.settings.device)
    mine = [item for item in request.session.items if item.module is request.module and hasattr(item, "callspec")]
    seeds = [item.callspec.params["seed"] for item in mine if "seed" in item.callspec.params]
    names = [item.callspec.params["name"] for item in mine if "name" in item.callspec.params]
    for seed in seeds:
        for index, (config, selection) in enumerate(control_selections(lane).items()):
            out = tmp_path_factory.mktemp(f"control-{seed}-{index}")
            children.start(("control", seed, index), _control_args(selection, seed), config, out)
    for name in names:
        kill = CATALOGUE[name].on(lane)
        if isinstance(kill, Kill):
            children.start(("mutant", name), _mutant_args(name, kill), kill, tmp_path_factory.mktemp(f"mutant-{name}"))


def _mutant_args(name: str, kill: Kill) -> list[str]:
    return [*kill.tests, "--parity-target", CATALOGUE[name].target, "-x"]


def _control_args(selection: list[str], seed: int) -> list[str]:
    return [*selection, "--parity-target", "serving", "--parity-seed", str(seed)]


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
    code, rows, tail = sessions.result(("mutant", name), _mutant_args(name, kill), kill, tmp_path)
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
        code, rows, tail = sessions.result(("control", seed, index), _control_args(selection, seed), config, out)
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

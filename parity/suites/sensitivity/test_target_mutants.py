"""target_mutants: the suites can fail on this target. Each planted mutant applicable to it must be killed.

With `--parity-mutants` (`parity run --mutants`), every mutant of the planted catalogue
(`parity/suites/sensitivity/planted.py`) is planted in the run's own target through a surface the
contract already has (its checkpoint, its config, its capture-probe registry, the calls it
receives: `plant.py`) and the tests its entry selects run against it in an isolated pytest session
(batched on the fork server of the built-in catalogue, `runs.py`). Killed: a gate row of the
mutant's suite failed. A mutant that cannot show on this target (a family it leaves out, a lane
where it is equivalent, a checkpoint or config without what it changes, a selection whose every
test skips here) is `not_applicable` with its reason, never a pass. Any other outcome is a
survivor: a defect of this kind would ship past the suites on this target. The unmutated target
runs the same selections under seeds 1, 2, 3 and must raise no alarm. `parity run` prints
`mutation score on <target name>: K/N`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from parity.compare import NOT_APPLICABLE, Verdict, better_of, flag_rule, with_rule
from parity.suites.sensitivity.catalogue import lane_of
from parity.suites.sensitivity.plant import PLANTED, kill_verdict, lane_kill, not_applicable, provided_families
from parity.suites.sensitivity.runs import (
    CONTROL_SEEDS,
    EARLY_SESSIONS,
    PLANTED_MODULE,
    ChildSessions,
    parallel_sessions,
)

pytestmark = [pytest.mark.parity_suite("target_mutants"), pytest.mark.parity_slow]


@pytest.fixture(scope="module")
def sessions(
    request: pytest.FixtureRequest, settings, target, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChildSessions]:
    """The sessions a serial run started at its first test (`parity/suites/conftest.py`), else a
    server of this module's own."""
    early = request.config.stash.get(EARLY_SESSIONS, None)
    if early is not None:
        early.all_cores()
        yield early
        return
    families = provided_families(target)
    with ChildSessions.open(settings, parallel_sessions(settings.device), families=families) as children:
        if children.parallel > 1:
            mine = [item for item in request.session.items if item.path.name == PLANTED_MODULE]
            children.start_selected(mine, tmp_path_factory)
        yield children


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_mutant_is_killed(name: str, report, settings, target, sessions, tmp_path: Path) -> None:
    entry = PLANTED[name]
    lane = lane_of(settings.device)
    reason = not_applicable(entry, lane, provided_families(target))
    if reason is not None:
        verdict = Verdict(NOT_APPLICABLE, "killed", None, None, f"{entry.defect} || {reason}", better=better_of("killed"))
        report.verdict(verdict, case=name, mode=entry.suite, site=entry.surface)
        return
    kill = lane_kill(entry, settings.device, settings.tp)
    session = sessions.planted_session(name, tmp_path)
    assert session is not None  # applicable here, so it has a session
    code, rows, tail = sessions.result(session)
    where = f"{lane} lane, {kill.size}" + (f" {kill.dtype}" if kill.dtype else "") + (f", tp {kill.tp}" if kill.tp > 1 else "")
    verdict = kill_verdict(entry, code, rows, tail, where)
    if kill.why:
        verdict = dataclasses.replace(verdict, detail=with_rule(verdict.detail, kill.why), rule=kill.why)
    report.verdict(verdict, case=name, mode=entry.suite, site=entry.surface)


@pytest.mark.parametrize("seed", CONTROL_SEEDS)
def test_the_unmutated_target_raises_no_alarm(seed: int, report, settings, sessions, tmp_path: Path) -> None:
    """Every selection of the applicable planted mutants, on the run's own target under `seed`: no
    failing gate row, every session exited cleanly with rows."""
    alarms, cases, exits, tails = [], 0, [], []
    planned = sessions.planted_control_sessions(seed, tmp_path)
    for session in planned:
        code, rows, tail = sessions.result(session)
        exits.append(code)
        if rows is None:
            tails.append(f"{session.kill.size}/{session.kill.dtype or 'lane dtype'}: no rows ({tail[:200]})")
            continue
        alarms.append(rows[(rows["kind"] == "gate") & rows["verdict"].isin(["fail", "error"])])
        cases += rows[["suite", "case", "mode"]].drop_duplicates().shape[0]
    found = pd.concat(alarms) if alarms else pd.DataFrame()
    ok = bool(planned) and all(code == 0 for code in exits) and found.empty and not tails
    detail = f"{cases} cases of the planted mutants' selections on the unmutated target with --seed {seed}: " + (
        "no alarm"
        if ok
        else f"{len(planned)} sessions, exits {exits}; "
        + "; ".join(f"{r.suite}/{r.case}/{r.mode} {r.metric}={r.value}" for r in found.head(5).itertuples())
        + " "
        + " ".join(tails)
    )
    report.verdict(
        flag_rule(ok, metric="false_alarms", value=len(found), threshold=0, detail=detail),
        case=f"unmutated-target-seed-{seed}",
        mode="all",
    )

"""sensitivity: every suite can fail. Each known-bad target of the catalogue must be killed.

For every mutant of `parity/suites/ar/mutants.py` the suite runs, against the mutant, the tests that its
catalogue entry selects for this run's lane (`cpu` or `cuda`, at the entry's size and dtype), in
an isolated pytest session (several per forked child of a pre-imported server, each patch put
back before the next: `parity/suites/sensitivity/isolation.py`), and records whether a gate row of the mutant's suite failed, with the row that killed it.
A survivor is a gap in a suite and fails here. A mutant that cannot show on this lane (an
equivalent mutant at that configuration) is recorded `not_applicable` with its reason: never a
pass, and not counted as applicable. The correct target must raise no alarm on the same
selections under three other seeds (no false alarms; the selections no seed can change under the
first of them only, or not at all when this run runs them itself: `runs.SEED_INDEPENDENT`). vllm-project/vllm-omni#7455's lesson: emptying
`_repeated_blocks` passed all four tests of the original compile-parity suite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from parity.compare import NOT_APPLICABLE, Verdict, better_of, flag_rule, with_rule
from parity.localise.rows import BLAME_METRIC
from parity.suites.sensitivity.catalogue import NotApplicable, lane_of
from parity.suites.sensitivity.runs import (
    CATALOGUE,
    CONTROL_SEEDS,
    EARLY_SESSIONS,
    SENSITIVITY_MODULE,
    ChildSessions,
    parallel_sessions,
    run_covers_seed_independent,
)

pytestmark = [pytest.mark.parity_suite("sensitivity"), pytest.mark.parity_slow]


@pytest.fixture(scope="module")
def sessions(request: pytest.FixtureRequest, settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChildSessions]:
    """The run's isolated pytest sessions: those a serial run started at its first test
    (`parity/suites/conftest.py`), else a server of this module's own."""
    early = request.config.stash.get(EARLY_SESSIONS, None)
    if early is not None:
        early.all_cores()
        yield early
        return
    covered = run_covers_seed_independent(request.session.items, settings)
    with ChildSessions.open(settings, parallel_sessions(settings.device), covered=covered) as children:
        if children.parallel > 1 and settings.target == "serving":
            mine = [item for item in request.session.items if item.path.name == SENSITIVITY_MODULE]
            children.start_selected(mine, tmp_path_factory)
        yield children


def _failing(rows: pd.DataFrame | None, suite: str | None = None) -> pd.DataFrame:
    if rows is None:
        return pd.DataFrame()
    gates = rows[(rows["kind"] == "gate") & rows["verdict"].isin(["fail", "error"])]
    return gates if suite is None else gates[gates["suite"] == suite]


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_mutant_is_killed(name: str, report, settings, sessions, tmp_path: Path) -> None:
    mutant = CATALOGUE[name]
    lane = lane_of(settings.device)
    kill = mutant.on(lane)
    if isinstance(kill, NotApplicable):
        report.verdict(
            Verdict(
                NOT_APPLICABLE,
                "killed",
                None,
                None,
                f"{mutant.defect} || not applicable on the {lane} lane: {kill.reason}",
                better=better_of("killed"),
            ),
            case=name,
            mode=mutant.suite,
        )
        return
    code, rows, tail = sessions.result(sessions.mutant_session(name, tmp_path))
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
    verdict = flag_rule(killed, metric="killed", detail=with_rule(f"{mutant.defect} || {detail}", kill.why))
    report.verdict(dataclasses.replace(verdict, rule=kill.why), case=name, mode=mutant.suite)
    if killed and (mutant.stage or mutant.stage_note):
        report.verdict(localisation_verdict(mutant, rows), case=name, mode=mutant.suite, site=mutant.stage)


def named_stages(rows: pd.DataFrame | None, suite: str) -> list[str]:
    """The stages the mutant's failing cases were localised to (`first_diverging_stage` rows), in row order."""
    if rows is None or rows.empty:
        return []
    blamed = rows[
        (rows["metric"] == BLAME_METRIC) & (rows["suite"] == suite) & (pd.to_numeric(rows["value"], errors="coerce") == 1)
    ]
    return [str(site) for site in blamed["site"]]


def localisation_verdict(mutant, rows: pd.DataFrame | None) -> Verdict:
    """Every localised case of a killed mutant names the catalogue's stage (docs/localise.md); a
    mutant whose defect sits in no one stage, or in one the chain cannot name, is not applicable,
    with the catalogue's reason (docs/localisation.md lists them)."""
    named = named_stages(rows, mutant.suite)
    seen = ", ".join(f"{site} x{named.count(site)}" for site in dict.fromkeys(named)) or "no stage (no case was localised)"
    if mutant.stage_note:  # in no one stage, or in one the chain cannot name (the catalogue says why)
        what = f"a known miss of {mutant.stage}" if mutant.stage else "in no one stage"
        return Verdict(
            NOT_APPLICABLE,
            "localised_stage",
            None,
            None,
            f"{what}: {mutant.stage_note}; named: {seen}",
            better=better_of("localised_stage"),
        )
    ok = bool(named) and set(named) == {mutant.stage}
    return flag_rule(ok, metric="localised_stage", detail=f"expected {mutant.stage}; named: {seen}")


@pytest.mark.parametrize("seed", CONTROL_SEEDS)
def test_correct_target_raises_no_alarm(seed: int, report, settings, sessions, tmp_path: Path) -> None:
    lane = lane_of(settings.device)
    alarms, cases, exits, tails, kept = [], 0, [], [], []
    for session in sessions.control_sessions(seed, tmp_path):
        code, rows, tail = sessions.result(session)
        exits.append(code)
        if rows is None:
            tails.append(f"{session.kill.size}/{session.kill.dtype or 'lane dtype'}: no rows ({tail[:200]})")
            continue
        alarms.append(_failing(rows))
        kept.append(rows)
        cases += rows[["suite", "case", "mode"]].drop_duplicates().shape[0]
    found = pd.concat(alarms) if alarms else pd.DataFrame()
    localised = sum(len(named_stages(rows, suite)) for suite in ("numerics", "decode", "image", "routing") for rows in kept)
    ok = all(code == 0 for code in exits) and found.empty and not tails and localised == 0
    detail = f"{cases} cases of the {lane} lane's catalogue tests on the correct target with --seed {seed}: " + (
        "no alarm, no case localised"
        if ok
        else f"exits {exits}; "
        + "; ".join(f"{r.suite}/{r.case}/{r.mode} {r.metric}={r.value}" for r in found.head(5).itertuples())
        + " "
        + " ".join(tails)
        + f"; {localised} cases localised to a stage"
    )
    # no alarm row, and every child exited cleanly with rows: the flag decides, the row counts the alarms
    report.verdict(
        flag_rule(ok, metric="false_alarms", value=len(found), threshold=0, detail=detail),
        case=f"correct-target-seed-{seed}",
        mode="all",
    )

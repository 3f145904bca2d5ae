"""The CPU lane: every parity suite on the built-in target, as `parity run` runs it, judged here.

The suites run once per test session, in the lane run every reader of this directory shares
(tests/support/shared_run.py); these tests read its rows: one test per report suite (its gate rows, so a
red suite names itself in pytest's summary), the mutation score, and the run's own record of how
it ended.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from parity.report import RUN_INFO_FILE, mutation_score
from tests.support.shared_run import ALL_SUITES, SharedRun

pytestmark = pytest.mark.parity_slow


def _describe(rows: pd.DataFrame) -> str:
    return "\n".join(
        f"{r.suite}/{r.case}/{r.mode} {r.site} {r.metric}={r.value}: {str(r.detail)[:300]}" for r in rows.head(20).itertuples()
    )


def test_the_lane_run_completed(lane_run: SharedRun) -> None:
    assert lane_run.returncode == 0, lane_run.stdout[-4000:]
    info = json.loads((lane_run.run_dir / RUN_INFO_FILE).read_text())
    assert info["status"] == "complete", info


@pytest.mark.parametrize("suite", ALL_SUITES)
def test_every_gate_row_of_the_suite_passes(lane_run: SharedRun, suite: str) -> None:
    frame = lane_run.rows
    rows = frame[frame["suite"] == suite]
    assert not rows.empty, f"the lane run wrote no {suite} row"
    gates = rows[rows["kind"] == "gate"]
    failing = gates[gates["verdict"].isin(["fail", "error"])]
    assert failing.empty, f"{len(failing)} failing {suite} gate row(s):\n{_describe(failing)}"


def test_every_applicable_mutant_is_killed(lane_run: SharedRun) -> None:
    score = mutation_score(lane_run.rows)
    assert score is not None and score.applicable > 0
    assert score.killed == score.applicable and not score.survivors, score.line()
    assert score.line() in lane_run.stdout  # `parity run` prints the score it computed from the same rows

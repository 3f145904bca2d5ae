"""Bad input of tensor-parallel runs (`--tp 2`): targets whose ranks do not keep up. Each row runs a
real `parity run --tp 2` (its ranks started by torch's launcher) with a target variant that hangs
on one rank, and names the words of the one line that must explain it, checked as
tests/harness/test_bad_inputs.py checks its table (`check_bad_input`). The rows of the review's
tp checks (run.json's tp against the rows', rows of two sizes) are in
tests/harness/test_bad_inputs_review.py.

`test_the_checks_are_what_catch_these` runs each row again with its check switched off in every
rank (`tests.support.rank_switches`): the hang is never named, and the run whose peer never finished
reviews clean.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.bad_input_table import Bad, Outcome, check_bad_input, cli, process
from tests.support.helpers import run, run_parity

pytestmark = [pytest.mark.parity_cpu, pytest.mark.parity_slow]

VARIANTS = "tests.support.tp_target_variants"
STALL = {"PARITY_STALL_S": "20"}  # a broken group is named after 20 s without progress
# A generous hang guard for the child where `run` takes one (a stall-guarded `run`, docs/lanes.md §5, takes none).
LIMIT = {"timeout": 900} if "timeout" in inspect.signature(run).parameters else {}


def tp_run(target: str, suite: str, *, review: bool = False, switch: str = "", **env: str) -> Callable[[Path], Outcome]:
    """`parity run --tp 2 --suite SUITE --target VARIANTS:TARGET`; with `review`, the outcome is that
    of `parity review` of the run it left. `switch`: the check `tests.support.rank_switches` turns off."""

    def run(tmp_path: Path) -> Outcome:
        args = [
            "run",
            "--tp",
            "2",
            "--suite",
            suite,
            "--target",
            f"{VARIANTS}:{target}",
            "--report-dir",
            str(tmp_path),
            "--run-id",
            "r",
        ]
        if switch:
            args += ["--", "-p", "tests.support.rank_switches"]
            env["PARITY_TEST_SWITCH_OFF"] = switch
        outcome = process(run_parity(args, **LIMIT, **STALL, **env))
        if not review:
            return outcome
        return cli("review", tmp_path / "r", "--no-baseline")

    return run


# fmt: off
BAD_RANKS = [
    # docs/lanes.md §5: a rank's health is its heartbeat; the up-front target check is one process's, so rank 0's own factory may hang
    Bad("tp-rank0-factory-hangs", tp_run("make_target_rank0_hangs", "weight_coverage"), ("parity: rank 0: tensor-parallel group broken: no rank made progress for 20 s", "rank 0 at calling the target's factory")),
    # docs/targets.md §11: run.json is complete only when every rank finished its tests
    Bad("tp-rank-never-finishes", tp_run("make_target_rank1_hangs", "selfcheck", review=True), ("INCOMPLETE RUN: the run was interrupted (tensor-parallel group broken: rank 1", "calling the target's factory")),
]
# fmt: on
EXIT = {"tp-rank0-factory-hangs": 2, "tp-rank-never-finishes": 3}


@pytest.mark.parametrize("row", [pytest.param(row, id=row.id) for row in BAD_RANKS])
def test_bad_input(row: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outcome = check_bad_input(row, tmp_path, monkeypatch)
    assert outcome.code == EXIT[row.id], outcome.output


# Each row's check switched off in every rank. The hanging factory returns after 30 s (so the
# broken variant's run ends by itself; the collectives wait for it), and nothing names it.
SWITCHED_OFF = {
    "tp-rank0-factory-hangs": tp_run(
        "make_target_rank0_hangs", "weight_coverage", switch="stall-guard", PARITY_TEST_HANG_S="30", PARITY_TP_TIMEOUT_S="600"
    ),
    "tp-rank-never-finishes": tp_run("make_target_rank1_hangs", "selfcheck", review=True, switch="rank-ends"),
}


@pytest.mark.parametrize("row_id", sorted(SWITCHED_OFF))
def test_the_checks_are_what_catch_these(row_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Switched off, the hang passes without a word, and the run a rank never finished reviews clean (exit 0)."""
    monkeypatch.chdir(tmp_path)
    row = next(row for row in BAD_RANKS if row.id == row_id)
    outcome = SWITCHED_OFF[row_id](tmp_path)
    explaining = [line for line in outcome.output.splitlines() if all(word in line for word in row.expect)]
    assert not explaining, outcome.output
    if row_id == "tp-rank-never-finishes":
        assert outcome.code == 0, outcome.output

"""A pytest plugin that switches one of the tensor-parallel checks off in every rank, for the
bad-input table's broken variants (tests/harness/test_bad_inputs_ranks.py): `-p
tests.support.rank_switches` on the command line (the launcher hands it to every rank), the check
named by `PARITY_TEST_SWITCH_OFF`:

- `stall-guard`: rank 0's judge never finds the group stalled or a heartbeat lost;
- `rank-ends`: rank 0 does not wait for the peers' ends and counts every rank as finished.
"""

from __future__ import annotations

import os

import pytest

SWITCH_ENV = "PARITY_TEST_SWITCH_OFF"


def pytest_configure(config: pytest.Config) -> None:
    from parity.plugin import rank_health, ranks

    switch = os.environ.get(SWITCH_ENV, "")
    if switch == "stall-guard":
        rank_health.HealthJudge.verdict = lambda self: None  # type: ignore[method-assign]
    elif switch == "rank-ends":
        ranks.RankGroup.finish_rank0 = lambda self, results, **how: ranks.RankEnd([], [], {})  # type: ignore[method-assign]
    elif switch:
        raise pytest.UsageError(f"{SWITCH_ENV}={switch!r}: expected stall-guard or rank-ends")

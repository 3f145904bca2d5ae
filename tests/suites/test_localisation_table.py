"""docs/localisation.md is the lane run's answer, and a correct target triggers no localisation.

The table is generated from the CPU lane's `localised_stage` rows (`parity.suites.sensitivity.localisation`):
it must equal what the session's lane run gives, and that run must name at least 90% of the
single-stage mutants exactly (the sensitivity suite already fails any that names another stage).
"""

from __future__ import annotations

import pytest

from parity.localise.rows import BLAME_METRIC, EXACT_METRIC, PIECE_METRIC, STAGE_METRIC
from parity.suites.sensitivity.localisation import TARGET_SHARE, in_scope, markdown, share_named
from tests.support.helpers import PROJECT_ROOT
from tests.support.shared_run import SharedRun

pytestmark = [pytest.mark.parity_cpu, pytest.mark.parity_slow]

DOC = PROJECT_ROOT / "docs" / "localisation.md"
REGENERATE = "python -m parity.suites.sensitivity.localisation RUN_DIR > docs/localisation.md"


def test_the_table_is_what_the_lane_run_found(lane_run: SharedRun) -> None:
    assert lane_run.returncode == 0, lane_run.stdout[-3000:]
    assert DOC.read_text() == markdown(lane_run.rows), f"docs/localisation.md is stale: regenerate it with `{REGENERATE}`"


def test_at_least_the_bar_of_single_stage_mutants_is_named_exactly(lane_run: SharedRun) -> None:
    assert in_scope(), "no mutant in the localising suites"
    share = share_named(lane_run.rows)
    assert share >= TARGET_SHARE, f"{share:.0%} of single-stage mutants named exactly (bar {TARGET_SHARE:.0%})"


def test_a_correct_target_triggers_no_localisation(suites_run: SharedRun) -> None:
    frame = suites_run.rows
    localised = frame[frame["metric"].isin([BLAME_METRIC, STAGE_METRIC, EXACT_METRIC, PIECE_METRIC])]
    assert localised.empty, localised[["suite", "case", "mode", "site", "detail"]].head().to_string()

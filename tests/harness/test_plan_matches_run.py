"""check-target's plan is the run's selection: for an AR-only target the suites the plan runs are
the suites with rows, and each (suite, family) it leaves out is one `family_not_provided` row.

Before, the plan was drawn per family (`recompiles  skip  DiT` for an AR-only target, then 25 AR
recompile cases ran) while the run skipped test by test (743 skip rows). Both now come from
`parity.target.suite_plan`; these tests compare the plan with what two AR-only examples' runs
(tests/support/shared_run.py) wrote, and show the comparison goes red on the old plan and the old rows.
"""

from __future__ import annotations

import pandas as pd
import pytest

from parity.conformance import check_target
from parity.report import NOT_PROVIDED
from parity.target import FAMILIES, SuitePlan, resolve_target, suite_plan
from tests.support.shared_run import SharedRun

pytestmark = [pytest.mark.parity_cpu, pytest.mark.parity_slow]


def differences(plans: list[SuitePlan], frame: pd.DataFrame, selected: tuple[str, ...]) -> list[str]:
    """Where a run's rows and a plan disagree, over the suites the run selected."""
    plans = [plan for plan in plans if plan.suite in selected]
    left_out = frame[frame["metric"] == NOT_PROVIDED]
    ran = set(frame.loc[frame["metric"] != NOT_PROVIDED, "suite"])
    found = []
    for plan in plans:
        if plan.ok != (plan.suite in ran):
            found.append(
                f"{plan.suite}: plan says {'run' if plan.ok else 'skip'}, the run {'wrote' if plan.suite in ran else 'has no'} rows"
            )
        planned = {key for key, _ in plan.skipped if key in FAMILIES}
        written = set(left_out.loc[(left_out["suite"] == plan.suite) & left_out["case"].isin(FAMILIES), "case"])
        if planned != written:
            found.append(
                f"{plan.suite}: plan leaves out {sorted(planned)}, the run wrote not-provided rows for {sorted(written)}"
            )
    per_test_skips = frame[(frame["metric"] == "skipped") & frame["detail"].str.contains("provides no", na=False)]
    if not per_test_skips.empty:
        found.append(f"{len(per_test_skips)} skip rows for families the target does not provide (one row per family wanted)")
    return found


@pytest.mark.parametrize("run_fixture", ["minimal_run", "example_run"])
def test_the_plan_is_what_the_run_ran(run_fixture: str, request: pytest.FixtureRequest) -> None:
    run: SharedRun = request.getfixturevalue(run_fixture)
    assert run.returncode == 0, run.stdout[-3000:]
    target = resolve_target(run.spec.target)
    assert differences(suite_plan(target, run.spec.target), run.rows, run.spec.suites) == []
    # check-target prints that plan: run/skip per suite as the run did.
    text = check_target(target, run.spec.target, suites=["selfcheck"]).text()
    for plan in suite_plan(target, run.spec.target):
        assert any(line.split()[:2] == [plan.suite, "run" if plan.ok else "skip"] for line in text.splitlines()), plan


def test_an_ar_only_run_is_one_line_per_family_it_leaves_out(minimal_run: SharedRun) -> None:
    frame = minimal_run.rows
    rows = frame[frame["metric"] == NOT_PROVIDED]
    assert set(rows["case"]) == {"dit", "routing", "sensitivity"}
    assert (rows["verdict"] == "skip").all() and (rows["kind"] == "info").all()
    assert (pd.to_numeric(rows["value"]) > 0).all()  # the tests each row stands for
    for line in ("not run: dit (", "not run: routing (routing:", "not run: sensitivity (sensitivity:"):
        assert line in minimal_run.stdout


def test_the_comparison_goes_red_on_the_old_plan_and_the_old_rows(minimal_run: SharedRun) -> None:
    """The plan drawn per family said `recompiles skip` for an AR-only target; the run skipped
    test by test. Either disagrees with a correct run or plan."""
    target = resolve_target(minimal_run.spec.target)
    plans = suite_plan(target, minimal_run.spec.target)
    old_plan = [SuitePlan(p.suite, (), p.skipped) if p.suite == "recompiles" else p for p in plans]
    assert any("recompiles: plan says skip" in d for d in differences(old_plan, minimal_run.rows, minimal_run.spec.suites))
    frame = minimal_run.rows
    old_rows = frame[frame["metric"] != NOT_PROVIDED].copy()
    skip = frame.iloc[[0]].assign(
        suite="image", case="dit-square", metric="skipped", verdict="skip", detail="target 'minimal-ar' provides no DiT"
    )
    differing = differences(plans, pd.concat([old_rows, skip]), minimal_run.spec.suites)
    assert any("skip rows for families" in d for d in differing) and any("leaves out ['dit']" in d for d in differing)

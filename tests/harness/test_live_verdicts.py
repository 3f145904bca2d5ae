"""Verdicts as soon as they are known (docs/cli.md §11): a full `parity run` (no --quick) of a
target with a planted numerics defect prints the failing case's one-line verdict when its test is
judged, before any expert_selection test ran, and `-x` stops the run there with its rows kept.

Read from the order of the output lines (pytest -v names each test as it ends), never a clock.
Each check is shown red on a switched-off variant: the live lines unregistered (the line then
only comes in the summary), and expert selection ordered ahead of numerics
(tests/support/order_switches.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from parity.report import read_results
from parity.report.schema import NOT_PROVIDED
from tests.support.helpers import run_parity
from tests.support.stage_defects import DEFECTS

pytestmark = [pytest.mark.parity_cpu, pytest.mark.parity_slow]

DEFECT = DEFECTS["engine-eps-outside-sqrt"]  # layer 0's norm: numerics in eager finds it at once


def _run(tmp_path: Path, *pytest_args: str) -> tuple[int, list[str], Path]:
    done = run_parity(
        ["run", "--target", DEFECT.factory, "--report-dir", str(tmp_path), "--run-id", "r", "--", "-x", "-v", *pytest_args]
    )
    return done.returncode, (done.stdout + done.stderr).splitlines(), tmp_path / "r"


def live_line(lines: list[str]) -> int | None:
    """Where the numerics failure's own line is, if it came before pytest's failure report."""
    end = next((i for i, line in enumerate(lines) if "= FAILURES =" in line), len(lines))
    return next(
        (i for i, line in enumerate(lines[:end]) if line.startswith("FAILED numerics: ") and DEFECT.stage in line),
        None,
    )


def expert_selection_before(lines: list[str], index: int) -> list[str]:
    return [line for line in lines[:index] if "test_expert_selection.py::" in line]


def test_a_numerics_defect_is_printed_before_expert_selection_runs(tmp_path: Path) -> None:
    code, lines, run_dir = _run(tmp_path)
    assert code == 1, "\n".join(lines[-40:])
    index = live_line(lines)
    assert index is not None, "no live numerics line before the failure report:\n" + "\n".join(lines[-60:])
    assert expert_selection_before(lines, index) == []
    # -x: the run stopped at that case, kept its rows and says it stopped early
    assert not any("test_expert_selection.py::" in line for line in lines)
    rows = read_results(run_dir / "results.csv")
    ran = rows[rows["metric"] != NOT_PROVIDED]  # the suites of the families the example lacks: one row each
    assert set(ran["suite"]) == {"numerics"} and (ran["verdict"] == "fail").any()
    assert any("stopped early" in line for line in lines)


def test_the_live_line_check_goes_red_without_the_live_lines(tmp_path: Path) -> None:
    _, lines, _ = _run(tmp_path, "-p", "no:parity-live-verdicts")
    assert live_line(lines) is None


def test_the_order_check_goes_red_with_expert_selection_first(tmp_path: Path) -> None:
    _, lines, _ = _run(tmp_path, "-p", "tests.support.order_switches")
    index = live_line(lines)
    assert index is not None and expert_selection_before(lines, index) != []


def _run_order(tmp_path: Path, *pytest_args: str) -> list[str]:
    """The node ids of a full run's selection, in the order they would run (`--collect-only`)."""
    done = run_parity(["run", "--report-dir", str(tmp_path), "--run-id", "c", "--", "--collect-only", "-q", *pytest_args])
    return [line for line in done.stdout.splitlines() if line.startswith("parity/suites/") and "::" in line]


def order_problems(order: list[str]) -> list[str]:
    """Where the run order breaks the rule of docs/cli.md §11: every numerics test in eager before
    the first expert_selection test, every eager test before the first compiled-mode one."""

    def first(pred) -> int:
        return next((i for i, node in enumerate(order) if pred(node)), len(order))

    def last(pred) -> int:
        return max((i for i, node in enumerate(order) if pred(node)), default=-1)

    problems = []
    numerics_eager = last(lambda n: "test_numerics.py::" in n and "[eager" in n)
    if numerics_eager > first(lambda n: "test_expert_selection.py::" in n):
        problems.append("a numerics test in eager runs after the first expert_selection test")
    if last(lambda n: "[eager" in n and "/sensitivity/" not in n) > first(lambda n: "[compiled" in n):
        problems.append("an eager test runs after the first compiled-mode test")
    return problems


def test_a_full_runs_order_puts_numerics_in_eager_first(tmp_path: Path) -> None:
    order = _run_order(tmp_path)
    assert len(order) > 800, "the full lane's selection was not listed"
    assert order_problems(order) == []
    assert order_problems(_run_order(tmp_path, "-p", "tests.support.order_switches")) != []  # switched off: red


def test_under_xdist_the_controller_prints_each_line_on_its_own(tmp_path: Path) -> None:
    """The workers hand the lines over on the test's report; the controller starts each on a line
    of its own after xdist's progress letters (quick lane, numerics only: seconds)."""
    args = ["run", "--quick", "-n", "2", "--suite", "numerics", "--target", DEFECT.factory, "--report-dir", str(tmp_path)]
    done = run_parity(args)
    assert done.returncode == 1, done.stdout[-2000:]
    assert live_line(done.stdout.splitlines()) is not None, done.stdout[-3000:]

"""cases/quick.toml names every test function of parity's suites once, as run or left out, and
nothing else: a new suite test is a decision about the quick lane (docs/cli.md §11), not an
accident, and a renamed one cannot silently drop out of it. Read with `ast`, no collection."""

from __future__ import annotations

import ast
import collections

import pytest

from parity.plugin.quick import SUITES_DIR, QuickPlan

pytestmark = pytest.mark.parity_cpu


def suite_tests() -> dict[str, str]:
    """`family/test_x.py::test_y` -> its file, for every test function under parity/suites/."""
    found = {}
    for path in sorted(SUITES_DIR.rglob("test_*.py")):
        relative = path.relative_to(SUITES_DIR).as_posix()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found[f"{relative}::{node.name}"] = relative
    return found


def plan_problems(plan: QuickPlan, tests: dict[str, str]) -> list[str]:
    """What is wrong between the plan and the suites' tests ([] when every test is named once)."""
    problems = []
    names = collections.Counter([*plan.runs, *plan.left_out])
    for test, file in tests.items():
        count = names[test] + names[file]
        if count != 1:
            problems.append(f"{test} is named {count} times in cases/quick.toml (once: [[run]] or [[leave_out]])")
    files = set(tests.values())
    problems += [
        f"cases/quick.toml names {name}, which is no suite test" for name in names if name not in tests and name not in files
    ]
    problems += [f"cases/quick.toml [[run]] {name} keeps no case" for name, run in plan.runs.items() if not run.cases]
    return problems


def test_quick_toml_names_every_suite_test_once() -> None:
    assert plan_problems(QuickPlan.load(), suite_tests()) == []


def test_the_check_goes_red_on_a_test_the_plan_forgets_or_invents() -> None:
    plan, tests = QuickPlan.load(), suite_tests()
    forgotten = next(iter(plan.runs))
    runs = {k: v for k, v in plan.runs.items() if k != forgotten}
    assert any(forgotten in p for p in plan_problems(QuickPlan(plan.lane, runs, plan.left_out), tests))
    invented = {**plan.runs, "ar/test_numerics.py::test_nothing": plan.runs[forgotten]}
    assert any("test_nothing" in p for p in plan_problems(QuickPlan(plan.lane, invented, plan.left_out), tests))
    twice = {**plan.left_out, forgotten: plan.left_out[next(iter(plan.left_out))]}
    assert any(forgotten in p for p in plan_problems(QuickPlan(plan.lane, plan.runs, twice), tests))

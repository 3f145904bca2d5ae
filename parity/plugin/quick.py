"""The quick lane (`parity run --quick`, `--parity-quick`): every suite's property on the smallest
cases that show it, with no code generation, for the engineer who runs parity after each fix.

What runs is data, `cases/quick.toml`: the lane's modes and its compile backend, one `[[run]]` per
suite test that runs (the case ids it keeps) and one `[[leave_out]]` per suite test that does not,
each with its reason (docs/cli.md §11). Every test of parity's suites is named there, one way or
the other (`tests/repo/test_quick_lane.py`), so a new test is a decision, not an accident. The
rows of a quick run say so in their `size` (`tiny-quick`): a review compares them only with a
quick run or baseline, never with the full lane's (`parity.report.quick`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import Path
from typing import Any

import pytest

from parity.cases import Table, Unavailable, load_case_file

QUICK_FILE = "quick.toml"
SUITES_DIR = Path(__file__).resolve().parent.parent / "suites"


@dataclasses.dataclass(frozen=True)
class QuickLane:
    modes: list[str]  # the execution modes a quick run keeps (those of the run's device among them)
    compile_backend: str  # every compile a kept test makes uses this backend instead of Inductor
    reason: str


@dataclasses.dataclass(frozen=True)
class QuickRun:
    test: str  # `<family dir>/<file>::<test function>`, relative to parity/suites/
    cases: list[str]  # the case ids kept (pytest's parameter id without the mode; fnmatch patterns)
    reason: str


@dataclasses.dataclass(frozen=True)
class QuickLeaveOut:
    test: str  # a test function (`file::function`) or a whole file (`family/test_x.py`)
    reason: str


SCHEMA = {
    "lane": Table(QuickLane, many=False),
    "run": Table(QuickRun),
    "leave_out": Table(QuickLeaveOut),
}


class QuickPlanError(ValueError):
    """cases/quick.toml cannot select: unreadable, or a `[[run]]` that keeps none of its test's cases."""


@dataclasses.dataclass(frozen=True)
class QuickPlan:
    """The quick lane's selection, read from `cases/quick.toml`."""

    lane: QuickLane
    runs: dict[str, QuickRun]
    left_out: dict[str, QuickLeaveOut]

    @classmethod
    def load(cls) -> QuickPlan:
        """The plan; a `QuickPlanError` with the case file's own line where it cannot be read."""
        tables: Any = load_case_file(QUICK_FILE, SCHEMA)
        if isinstance(tables, Unavailable):  # read while the session collects: its error deferred
            raise QuickPlanError(tables.error)
        named = [r.test for r in [*tables["run"], *tables["leave_out"]]]
        twice = sorted({test for test in named if named.count(test) > 1})
        if twice:  # the built-in file and a --cases directory's both naming a test, or one file twice
            raise QuickPlanError(f"cases/{QUICK_FILE}: {twice[0]} is named more than once ([[run]] or [[leave_out]])")
        return cls(tables["lane"], {r.test: r for r in tables["run"]}, {r.test: r for r in tables["leave_out"]})

    def decide(self, item: pytest.Item) -> str | None:
        """None when `item` runs in the quick lane, else why not (an item outside parity's
        suites runs as selected: the lane chooses among parity's own tests only)."""
        key = test_key(item)
        if key is None:
            return None
        name, file = key, key.split("::", 1)[0]
        leave = self.left_out.get(name) or self.left_out.get(file)
        if leave is not None:
            return leave.reason
        run = self.runs.get(name)
        if run is None:
            return f"{name} is not named in cases/{QUICK_FILE} (neither [[run]] nor [[leave_out]])"
        params = getattr(getattr(item, "callspec", None), "params", {})
        mode = params.get("mode")
        if isinstance(mode, str) and mode not in self.lane.modes:
            return f"mode {mode}: the quick lane runs {', '.join(self.lane.modes)}"
        case = case_id(item)
        if not any(fnmatch.fnmatchcase(case, pattern) for pattern in run.cases):
            return f"case {case!r}: the quick lane keeps {', '.join(run.cases)} of this test"
        return None


def test_key(item: pytest.Item) -> str | None:
    """`ar/test_numerics.py::test_target_matches_reference_layer_by_layer` for a test of parity's
    suites, None for any other test."""
    try:
        relative = Path(str(item.path)).resolve().relative_to(SUITES_DIR)
    except ValueError:
        return None
    function = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
    return f"{relative.as_posix()}::{function}"


def case_id(item: pytest.Item) -> str:
    """The test's parameter id without its mode (`mixed` of `mixed-eager`; '' when unparametrized)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return ""
    parts = callspec.id.split("-")
    mode = callspec.params.get("mode")
    if isinstance(mode, str):
        for start in range(len(parts)):  # the mode's own id may hold '-' too
            width = len(mode.split("-"))
            if "-".join(parts[start : start + width]) == mode:
                del parts[start : start + width]
                break
    return "-".join(parts)


def select(config: pytest.Config, items: list[pytest.Item], plan: QuickPlan | None = None) -> QuickPlan:
    """Keep the quick lane's tests among `items` (the others deselected); the plan. A `[[run]]`
    whose test was selected but none of whose cases is kept is a `QuickPlanError`."""
    plan = plan or QuickPlan.load()
    drop = [item for item in items if plan.decide(item) is not None]
    dropped_ids = {id(item) for item in drop}
    kept = {test_key(item) for item in items if id(item) not in dropped_ids}
    for key in sorted({key for key in map(test_key, drop) if key is not None} - kept):
        run = plan.runs.get(key)
        if run is not None:  # a renamed case must not drop its test out of the lane unseen
            ids = sorted({case_id(item) for item in drop if test_key(item) == key})
            raise QuickPlanError(
                f"cases/{QUICK_FILE}: [[run]] {key} keeps none of its cases ({', '.join(run.cases)}); "
                f"its cases: {', '.join(ids) or '(none)'}"
            )
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if id(item) not in dropped_ids]
    return plan

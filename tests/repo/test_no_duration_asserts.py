"""No test judges the clock: a comparison of a measured duration in tests/ is a failure.

A busy machine makes every step slower; a test that compares elapsed seconds with a budget (`assert
seconds < 10`, `while time.monotonic() < deadline`) turns that slowness into a red verdict with
nothing wrong. Timings belong in benchmarks and docs/performance.md; a hang is bounded by a stall
guard (`parity.observe.progress`, docs/cli.md §9), never by a deadline.

Read from the source with `ast`, not grep: a value is *measured* when it comes from a clock call
(`time.monotonic()`, `time.perf_counter()`, `time.time()`, their `_ns` forms, `datetime.now()`),
from a name assigned one (`start`, `seconds = time.perf_counter() - start`, `deadline = time.monotonic()
+ 120`), or from a function of the same module returning one (a tuple's measured positions only).
Any comparison (`<`, `>`, `==`, ...) with a measured operand is reported with its file and line.
So is a deadline handed to a child process (`subprocess.run(..., timeout=120)`, `communicate(timeout=
...)`, the helpers' `run_pytest(..., timeout=900)`): on a loaded machine it kills a child that was
only slow, and the test goes red with nothing wrong.
`test_the_scan_sees_each_form` plants each form in a file of its own and shows the check go red.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLOCK_FUNCTIONS = frozenset(
    {"time", "monotonic", "perf_counter", "process_time", "thread_time", "time_ns", "monotonic_ns", "perf_counter_ns"}
)
CLOCK_MODULES = frozenset({"time"})
DATETIME_NOW = frozenset({"now", "utcnow", "today"})

# A measured value: True for the whole value, or the set of tuple positions that are measured.
Measured = bool | frozenset[int]


def _clock_names(tree: ast.Module) -> set[str]:
    """Names bound by `from time import monotonic` (and the like) in the module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in CLOCK_MODULES:
            names |= {alias.asname or alias.name for alias in node.names if alias.name in CLOCK_FUNCTIONS}
    return names


def _is_clock_call(node: ast.AST, clock_names: set[str]) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id in clock_names
    if isinstance(func, ast.Attribute):
        owner = func.value
        owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if owner_name in CLOCK_MODULES and func.attr in CLOCK_FUNCTIONS:
            return True
        return owner_name == "datetime" and func.attr in DATETIME_NOW
    return False


class _Scan:
    """The measured names of each function of one module, to a fixpoint, and the comparisons that use them."""

    def __init__(self, tree: ast.Module, *, follow: bool = True) -> None:
        self.tree = tree
        self.follow = follow  # False: the switched-off variant (direct clock calls only)
        self.clock_names = _clock_names(tree)
        self.returns: dict[str, Measured] = {}  # function name -> what its return holds

    def measured(self, node: ast.AST | None, names: dict[str, Measured]) -> Measured:
        """Whether `node` (an expression) holds a measured value."""
        if node is None:
            return False
        if isinstance(node, ast.Tuple):
            positions = frozenset(i for i, element in enumerate(node.elts) if self.measured(element, names) is True)
            return positions or False
        for sub in ast.walk(node):
            if _is_clock_call(sub, self.clock_names):
                return True
            if not self.follow:
                continue
            if isinstance(sub, ast.Name) and names.get(sub.id) is True:
                return True
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in self.returns:
                if sub is node:
                    return self.returns[sub.func.id]
                if self.returns[sub.func.id] is True:
                    return True
        return False

    def _bind(self, target: ast.AST, value: Measured, names: dict[str, Measured]) -> bool:
        """Mark the names `target` binds; True when something new was marked."""
        changed = False
        if isinstance(target, ast.Name):
            if value is True and names.get(target.id) is not True:
                names[target.id], changed = True, True
        elif isinstance(target, ast.Tuple | ast.List):
            for index, element in enumerate(target.elts):
                part = value if isinstance(value, bool) else index in value
                changed |= self._bind(element, bool(part), names)
        return changed

    def names_of(self, scope: ast.AST) -> dict[str, Measured]:
        names: dict[str, Measured] = {}
        changed = True
        while changed:
            changed = False
            for node in ast.walk(scope):
                if isinstance(node, ast.Assign):
                    value = self.measured(node.value, names)
                    for target in node.targets:
                        changed |= self._bind(target, value, names)
                elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr) and node.value is not None:
                    value = self.measured(node.value, names)
                    if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and names.get(node.target.id):
                        value = True
                    changed |= self._bind(node.target, value, names)
        return names

    def functions(self) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
        return [n for n in ast.walk(self.tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]

    def summarise(self) -> None:
        """What each function of the module returns, until nothing changes (a helper may return
        what another helper measured)."""
        if not self.follow:
            return
        changed = True
        while changed:
            changed = False
            for function in self.functions():
                names = self.names_of(function)
                found: Measured = False
                for node in ast.walk(function):
                    if isinstance(node, ast.Return):
                        value = self.measured(node.value, names)
                        if value is True or found is True:
                            found = True
                        elif value:
                            found = value | (found or frozenset())
                if found and self.returns.get(function.name) != found:
                    self.returns[function.name], changed = found, True

    def comparisons(self) -> Iterable[ast.Compare]:
        self.summarise()
        for scope in [self.tree, *self.functions()]:
            names = self.names_of(scope)
            for node in ast.walk(scope):
                if not isinstance(node, ast.Compare) or all(isinstance(op, ast.Is | ast.IsNot) for op in node.ops):
                    continue
                if any(self.measured(operand, names) is True for operand in (node.left, *node.comparators)):
                    yield node


def duration_comparisons(paths: Iterable[Path], *, root: Path, follow: bool = True) -> list[str]:
    """`file:line: source` of every comparison of a measured duration in `paths`."""
    found = set()
    for path in paths:
        source = path.read_text()
        for node in _Scan(ast.parse(source), follow=follow).comparisons():
            found.add(f"{path.relative_to(root)}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return sorted(found)


# Calls that start or wait for a child process; a `timeout=` on them is a deadline on its run.
CHILD_CALLS = frozenset(
    {"run", "call", "check_call", "check_output", "communicate", "wait", "run_pytest", "run_parity", "run_command", "run_watched"}
)


def child_deadlines(paths: Iterable[Path], *, root: Path) -> list[str]:
    """`file:line: source` of every child-process call given a `timeout=` other than None."""
    found = set()
    for path in paths:
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for keyword in node.keywords:
                if (
                    name in CHILD_CALLS
                    and keyword.arg == "timeout"
                    and not (isinstance(keyword.value, ast.Constant) and keyword.value.value is None)
                ):
                    found.add(f"{path.relative_to(root)}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return sorted(found)


def check_tree(root: Path, *, follow: bool = True) -> None:
    paths = sorted((root / "tests").rglob("*.py"))
    found = duration_comparisons(paths, root=root, follow=follow) + child_deadlines(paths, root=root)
    assert found == [], (
        "tests compare measured durations (a loaded machine turns them red; time in benchmarks and "
        "docs/performance.md, bound hangs with parity.observe.progress):\n" + "\n".join(found)
    )


def test_no_test_compares_a_measured_duration() -> None:
    check_tree(ROOT)


# ---------------------------------------------------------------------------------------------
# The scan itself: each form planted in a tree of its own turns the check red; its controls do not
# ---------------------------------------------------------------------------------------------

PLANTED = {
    "repro-budget": """
import subprocess, sys, time
def test_repro():
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"])
    seconds = time.perf_counter() - start
    assert seconds < 10, f"the repro took {seconds:.1f} s"
""",
    "deadline-loop": """
import time
def wait(path):
    deadline = time.monotonic() + 120
    while not path.exists():
        assert time.monotonic() < deadline
""",
    "helper-returns-a-duration": """
import time
def _session():
    start = time.monotonic()
    return 0, "output", time.monotonic() - start
def test_hang():
    code, output, seconds = _session()
    assert code == 0
    assert seconds < 150
""",
    "imported-clock": """
from time import perf_counter as clock
def test_fast():
    t0 = clock()
    elapsed = clock() - t0
    assert elapsed <= 1.0
""",
    "datetime": """
import datetime
def test_started():
    began = datetime.datetime.now()
    assert datetime.datetime.now() - began < datetime.timedelta(seconds=5)
""",
    "child-deadline": """
import subprocess, sys
def test_replay():
    result = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, timeout=120)
    assert result.returncode == 0
""",
    "communicate-deadline": """
import subprocess, sys
def test_agent():
    process = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE)
    output, _ = process.communicate(timeout=1200)
    assert process.returncode == 0
""",
}
# Not durations: an exit code beside a duration, seconds read from a file (a recorded value), a
# clock used only to print, an `is None` test, a child waited for with no deadline, a queue's timeout.
CONTROLS = """
import json, queue, subprocess, sys, time
def test_child():
    assert subprocess.run([sys.executable, "-c", "pass"], timeout=None).returncode == 0
    assert queue.Queue().get(timeout=1) is not None
def _session():
    start = time.monotonic()
    return 0, "output", time.monotonic() - start
def test_code():
    code, output, _ = _session()
    assert code == 0 and "output" in output
def test_recorded(path):
    seconds = json.loads(path.read_text())["suite_seconds"]
    assert seconds["selfcheck"] > 0
def test_printed():
    start = time.perf_counter()
    print(f"{time.perf_counter() - start:.1f} s")
    assert start is not None
"""


def _tree(tmp_path: Path, source: str) -> Path:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_planted.py").write_text(source)
    return tmp_path


@pytest.mark.parametrize("form", sorted(PLANTED))
def test_the_scan_sees_each_form(form: str, tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="test_planted.py"):
        check_tree(_tree(tmp_path, PLANTED[form]))


def test_the_controls_are_not_durations(tmp_path: Path) -> None:
    check_tree(_tree(tmp_path, CONTROLS))


@pytest.mark.parametrize("form", ["repro-budget", "helper-returns-a-duration"])
def test_a_scan_that_only_sees_clock_calls_misses_these(form: str, tmp_path: Path) -> None:
    """The switched-off variant (no flow through names and helpers, a grep-level scan): the
    forms the repro tests and the hung-rank test used pass it silently."""
    check_tree(_tree(tmp_path, PLANTED[form]), follow=False)

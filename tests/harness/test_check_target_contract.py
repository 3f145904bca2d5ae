"""The documented contract (docs/targets.md), `parity check-target` and the suites agree.

* Each form docs/targets.md §7 allows for a router's result (a plain `(weights, ids)` tuple, a
  NamedTuple with exactly those fields) passes check-target and the routing suite's contract row;
  each form it refuses (a NamedTuple with other fields, an object that is not a pair) fails both.
  One rule decides both (`parity.target.router_result_problem`): put the suite back on its old rule
  and the plain pair passes one and fails the other.
* A member that returns None where the suites need an object (`router()`) is a problem, not "ok".
* check-target runs in a child process: a target that exits, hangs or leaves a thread is named, and
  this process goes on (the rows of tests/harness/test_bad_inputs_targets.py show each one line).
* The suites check-target plans for are the suites the tests under parity/suites/ declare.

`test_the_checks_are_what_catch_these` switches each check off and shows a row of
tests/harness/test_bad_inputs_targets.py pass silently or lose its line.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from parity import conformance
from parity.compare import FAIL, PASS
from parity.conformance import FAMILIES, KNOWN_SUITES, check_target
from parity.plugin import lanes
from parity.suites.routing import support
from parity.target import resolve_target
from tests.harness.test_bad_inputs_targets import row
from tests.support import slippery_targets
from tests.support.helpers import PROJECT_ROOT, run_command, run_pytest_here

pytestmark = pytest.mark.parity_cpu

# The forms of a router result and whether docs/targets.md §7 allows them.
FORMS = {"plain": True, "named": True, "named_ids_first": False, "dataclass_result": False}
GRID = support.GridPoint("grouped", 64, 8, 16, "fp32", True)  # grouped sigmoid, one shared expert


def check_target_accepts(form: str) -> bool:
    result = check_target(slippery_targets.router_form(form), f"router-{form}", suites=["routing"])
    [routing] = [f for f in result.families if f.family.name == "routing"]
    return result.ok and not routing.problems


def suite_accepts(form: str) -> bool:
    """The routing suite's rows for one grid point and one pad point: the contract row decides."""
    router = slippery_targets.router_form(form).router()
    rows = support.grid_rows(router, GRID, torch.device("cpu"), seed=1)
    rows += support.pad_rows(router, support.PadPoint("softmax", "T-1", "garbage"), torch.device("cpu"), seed=1)
    contract = {r.verdict for r in rows if r.metric == "contract_violations"}
    assert contract in ({PASS}, {FAIL}), contract
    return contract == {PASS}


@pytest.mark.parametrize("form", FORMS)
def test_each_form_of_a_router_result_is_judged_alike(form: str) -> None:
    assert check_target_accepts(form) is FORMS[form]
    assert suite_accepts(form) is FORMS[form]


def _named_pair_only(result: Any) -> str | None:
    """The suite's rule before this check: a named pair, nothing else."""
    fields = getattr(result, "_fields", None)
    return None if fields == ("weights", "ids") else f"not the named pair (weights, ids): fields {fields}"


def test_one_rule_is_what_makes_them_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: the suite on its old rule rejects the documented plain pair that
    check-target accepts (580 failing routing cases in a porter's run)."""
    monkeypatch.setattr(support, "router_result_problem", _named_pair_only)
    assert check_target_accepts("plain") and not suite_accepts("plain")


@pytest.mark.parametrize("form", ["plain", "named"])
@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_each_documented_form_passes_check_target_and_a_routing_session(form: str, tmp_path: Path) -> None:
    """Through the real commands: `parity check-target` and a routing suite session (its edge
    cases: ties, NaN, pad rows, each with its contract row) on the target."""
    from tests.support.bad_input_table import cli

    spec = f"tests.support.slippery_targets:router_{form}"
    checked = cli("check-target", spec, "--suite", "routing")
    assert checked.code == 0 and "routing: ok (router)" in checked.output, checked.output
    assert f"({form} pair)" in checked.output
    args = [str(PROJECT_ROOT / "parity/suites/routing/test_edges.py"), "-k", "tie- or pad-T-1"]
    code, output = run_pytest_here(
        [*args, "--parity-target", spec, "--parity-report-dir", str(tmp_path / "reports"), "-q"], basetemp=tmp_path / "t"
    )
    assert code == 0, output[-3000:]
    assert "passed" in output and "failed" not in output


def test_router_returning_none_is_a_problem_not_ok() -> None:
    result = check_target(slippery_targets.router_returns_none(), "router-none", suites=["routing"])
    assert not result.ok
    assert result.all_problems() == ["router: target.router() returned None (expected a router adapter, docs/targets.md §7)"]
    assert "routing: PROBLEMS" in result.text()


def test_every_adapter_member_the_suites_call_is_called() -> None:
    """The serving target conforms, and the probe reports each member it called with what came back."""
    result = check_target(resolve_target("serving"), "serving")
    assert result.ok, result.all_problems()
    checked = "\n".join(c for f in result.families for c in f.checks)
    for call in (
        "forward(ids) of the adapter build_ar returned",
        ".und(x) ->",
        ".gen(x) ->",
        "module is an nn.Module",
        "timesteps -> [3]",
        "sample -> [1,",
        "decode -> uint8",
        "remap -> [4, 2]",
        "expert_load -> [8]",
        "num_shared_experts=1) -> ids int32 [4, 3]",
        "supports_capture True",
    ):
        assert call in checked, (call, checked)


def _suites_declared() -> set[str]:
    """Every `pytest.mark.parity_suite("...")` under parity/suites/."""
    found = set()
    for path in (PROJECT_ROOT / "parity" / "suites").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == lanes.SUITE
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.add(node.args[0].value)
    return found


def _suites_by_family() -> dict[str, set[str]]:
    """The suites each family directory's tests declare."""
    found: dict[str, set[str]] = {}
    for path in (PROJECT_ROOT / "parity" / "suites").rglob("test_*.py"):
        family = path.relative_to(PROJECT_ROOT / "parity" / "suites").parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == lanes.SUITE and node.args:
                found.setdefault(family, set()).add(node.args[0].value)
    return found


def test_check_target_plans_for_the_suites_that_exist() -> None:
    """`--suite` names and the plan come from conformance.FAMILIES / OTHER_SUITES: they must be the
    suites the tests declare, per family (before this check `sampler` and the AR `recompiles` were
    missing: `check-target --suite sampler` probed nothing)."""
    assert set(KNOWN_SUITES) == _suites_declared()
    by_family = _suites_by_family()
    for key, family in FAMILIES.items():
        assert set(family.suites) == by_family[key], key


# ---------------------------------------------------------------------------------------------
# The time limit is the target's: a fresh child's start-up is bounded by a stall, not a clock
# ---------------------------------------------------------------------------------------------


@pytest.mark.parity_slow  # two fresh interpreters, each slowed by seconds
def test_a_slow_start_up_is_not_charged_to_the_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh child spends seconds importing torch before any target code runs (on a loaded CI
    machine, more than a short `--timeout`: the row check-target-router-hangs once failed with the
    step "importing module"). Start-up is simulated here by a sitecustomize that sleeps longer than
    the time limit: the check still reaches the router and names it. Start-up has no time limit of
    its own, only a stall: a start-up that uses no CPU for the stall limit (this sleep, with a
    limit below it) gets its own line."""
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(6)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    spec = f"{slippery_targets.__name__}:router_hangs"
    hung = conformance.start_check(spec, suites=["routing"], fresh=True, quiet=True).wait(4)
    assert hung.lines == [
        f"target {spec} did not finish its check within 4 s: it hung in router: target.router() (docs/targets.md §1)"
    ], hung.lines
    late = conformance.start_check(spec, suites=["routing"], fresh=True, quiet=True).wait(4, stall=2)
    assert late.code == conformance.DOES_NOT_CONFORM
    assert late.lines == [
        f"the check's process for target {spec} made no progress for 2 s while starting (a fresh interpreter importing "
        "torch; before any target code ran; PARITY_STALL_S sets the limit)"
    ], late.lines


# ---------------------------------------------------------------------------------------------
# The checks are what catch these: switched off, rows of tests/harness/test_bad_inputs_targets.py go red
# ---------------------------------------------------------------------------------------------


def _in_this_process(spec: str, device: str = "cpu", suites: Any = (), **_: Any) -> Any:
    """`start_check` as check-target was before this check: resolve and probe in the calling process."""

    class Here:
        def wait(self, timeout: float) -> conformance.CheckOutcome:
            return conformance.check_here(spec, device, suites)

        def stop(self) -> None:
            pass

    return Here()


def _old_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    """`resolve_target` without its SystemExit handling: sys.exit passes through."""
    import importlib

    import parity.target

    def resolve(spec: str, option: str = "--target", **_: Any) -> Any:
        module, _, attr = parity.target.factory_path(spec, option).partition(":")
        return getattr(importlib.import_module(module), attr)()

    monkeypatch.setattr(parity.target, "resolve_target", resolve)
    monkeypatch.setattr(conformance, "resolve_target", resolve)


SWITCH_OFF: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "check-target-router-none": lambda patch: patch.setattr(
        conformance.Checks, "obtain", lambda self, call, fn, _: self.attempt(call, fn)
    ),
    "check-target-unknown-suite": lambda patch: patch.setattr("parity.cli.unknown_suites", lambda suites: []),
    "check-target-leaves-a-thread": lambda patch: patch.setattr(conformance, "threads_left", lambda before, grace=0: []),
    "check-target-router-dataclass": lambda patch: patch.setattr(
        "parity.suites.routing.conformance.router_result_problem", lambda result: None
    ),
    "check-target-factory-sys-exit": lambda patch: (
        patch.setattr("parity.cli.start_check", _in_this_process),
        _old_resolve(patch),
    ),
    "pytest-factory-sys-exit": _old_resolve,
}


@pytest.mark.parametrize("row_id", SWITCH_OFF)
@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_the_checks_are_what_catch_these(row_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check switched off (a broken variant of the harness): the row's mistake passes silently,
    or at least no longer gives its explaining line (with it on, tests/harness/test_bad_inputs_targets.py
    shows the row's line).

    In a fresh interpreter: check-target forks its child only from a process with one thread (this
    one may run a shared suites session beside the tests), and only a forked child sees the patch."""
    del monkeypatch
    script = (
        "import json, sys; from tests.harness.test_check_target_contract import variant_outcome; "
        "print(json.dumps(variant_outcome(sys.argv[1], sys.argv[2])))"
    )
    result = run_command([sys.executable, "-c", script, row_id, str(tmp_path)], cwd=PROJECT_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    code, output = json.loads(result.stdout.splitlines()[-1])
    explaining = [line for line in output.splitlines() if all(word in line for word in row(row_id).expect)]
    assert code == 0 or not explaining, output


def variant_outcome(row_id: str, tmp: str) -> tuple[int, str]:
    """The row's exit code and output with its check switched off (`SWITCH_OFF`), in this process."""
    tmp_path = Path(tmp)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        SWITCH_OFF[row_id](patch)
        try:
            outcome = row(row_id).run(tmp_path)
        except SystemExit as exc:  # sys.exit in the factory, obeyed: the command ends without a word
            return (exc.code if isinstance(exc.code, int) else 1), ""
    return outcome.code, outcome.output

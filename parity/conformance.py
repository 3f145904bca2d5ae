"""Conformance of a target to the contract (docs/targets.md), checked once before any suite runs.

`check_target(target, spec)` asks what `parity/target.py`'s Protocols describe, family by family:
the target's own members (`name`, the capture registry, `not_applicable`), which model families it
provides (`load_ar`/`build_ar`, `load_dit`/`build_dit`, `router()`), and for each provided family
a probe that builds the family on a tiny input and checks every adapter member, its return type
and shapes. The probes live with their family's suites (`parity/suites/<family>/conformance.py`,
named here by string so the core imports no model); a family a target leaves out is listed as
skipped with the reason. The result says which suites will run or skip and why.

`parity check-target SPEC` prints it; `parity run` runs it first (in a fresh process: calling a
target factory may patch modules, as the mutant catalogue's do) and stops with one line when a
member is missing or returns the wrong thing.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from typing import Any

from parity.target import ENGINE_POLICIES, CaptureRegistry, missing_members


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: the target members that provide it, its probe, and the suites that need it."""

    name: str
    members: tuple[str, ...]
    probe: str  # "module:function", called as probe(target, device) -> list of checks done
    suites: tuple[str, ...]


FAMILIES: dict[str, Family] = {
    "ar": Family(
        "AR",
        ("load_ar", "build_ar"),
        "parity.suites.ar.conformance:probe",
        ("expert_selection", "fail_closed_capture", "embedding_clamp", "numerics", "decode", "weight_coverage"),
    ),
    "dit": Family("DiT", ("load_dit", "build_dit"), "parity.suites.dit.conformance:probe", ("recompiles", "numerics", "image")),
    "routing": Family("routing", ("router",), "parity.suites.routing.conformance:probe", ("routing",)),
}
# Suites that need no model family of the target.
OTHER_SUITES = {
    "selfcheck": lambda spec: "",
    "sensitivity": lambda spec: "" if spec == "serving" else "the mutant catalogue mutates the built-in serving target",
    "benchmark": lambda spec: "only with --benchmarks",
}


class ConformanceError(RuntimeError):
    """A target that does not fulfil the contract; the message is one line per problem."""


@dataclasses.dataclass
class FamilyResult:
    family: Family
    provided: bool
    reason: str = ""  # why it is skipped, when not provided
    checks: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Conformance:
    """What `check_target` found: problems (each one line), families and the suites' plan."""

    spec: str
    name: str
    problems: list[str]
    families: list[FamilyResult]
    policies: dict[str, str]

    @property
    def ok(self) -> bool:
        return not self.problems and not any(f.problems for f in self.families)

    def all_problems(self) -> list[str]:
        return self.problems + [p for f in self.families for p in f.problems]

    def suite_plan(self) -> list[tuple[str, str, str]]:
        """(suite, family, reason it skips or '') for every suite, in run order."""
        plan: list[tuple[str, str, str]] = []
        for result in self.families:
            reason = "" if result.provided else result.reason
            plan += [(suite, result.family.name, reason) for suite in result.family.suites]
        plan += [(suite, "-", why(self.spec)) for suite, why in OTHER_SUITES.items()]
        return plan

    def text(self) -> str:
        lines = [f"target {self.name!r} ({self.spec})"]
        lines += [f"  problem: {p}" for p in self.problems]
        for result in self.families:
            name = result.family.name
            if not result.provided:
                lines.append(f"  {name}: skip: {result.reason}")
                continue
            status = "ok" if not result.problems else "PROBLEMS"
            lines.append(f"  {name}: {status} ({', '.join(result.family.members)})")
            lines += [f"    checked: {c}" for c in result.checks]
            lines += [f"    problem: {p}" for p in result.problems]
        if self.policies:
            lines.append("  engine policies declared not applicable (their checks write not_applicable rows):")
            lines += [f"    {policy}: {reason}" for policy, reason in self.policies.items()]
        lines.append("suites:")
        width = max(len(s) for s, _, _ in self.suite_plan())
        for suite, family, reason in self.suite_plan():
            lines.append(f"  {suite:<{width}}  {'skip' if reason else 'run ':<4}  {family}" + (f": {reason}" if reason else ""))
        return "\n".join(lines)


def _probe(path: str) -> Callable[[Any, str], list[str]]:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _target_problems(target: Any, spec: str) -> tuple[list[str], dict[str, str]]:
    problems = []
    name = getattr(target, "name", None)
    if not isinstance(name, str) or not name:
        problems.append(f"target {spec}: 'name' must be a non-empty str, got {name!r}")
    registry = getattr(target, "capture", None)
    if registry is None:
        problems.append(f"target {spec} lacks Target member: capture (a capture-probe registry)")
    else:
        missing = missing_members(registry, CaptureRegistry)
        if missing:
            problems.append(
                f"target {spec}: capture ({type(registry).__name__}) lacks CaptureRegistry members: {', '.join(missing)}"
            )
    declared = getattr(target, "not_applicable", None) or {}
    policies: dict[str, str] = {}
    if not hasattr(declared, "items"):
        problems.append(f"target {spec}: not_applicable must map engine policy -> reason, got {type(declared).__name__}")
        declared = {}
    for policy, reason in declared.items():
        if policy not in ENGINE_POLICIES:
            problems.append(
                f"target {spec}: not_applicable names unknown engine policy {policy!r}; known: {', '.join(ENGINE_POLICIES)}"
            )
        elif not isinstance(reason, str) or not reason.strip():
            problems.append(f"target {spec}: not_applicable[{policy!r}] needs a reason (a non-empty str)")
        else:
            policies[policy] = reason
    return problems, policies


def families_for(suites: Iterable[str]) -> set[str]:
    """The families whose suites are among `suites` (all of them for an empty selection)."""
    wanted = set(suites)
    return {key for key, family in FAMILIES.items() if not wanted or wanted & set(family.suites)}


def check_target(target: Any, spec: str, *, device: str = "cpu", suites: Iterable[str] = ()) -> Conformance:
    """Check `target` (what `spec`'s factory returned) against the contract on `device`; with
    `suites`, probe only the families those suites need (the others are listed, not probed)."""
    problems, policies = _target_problems(target, spec)
    probed = families_for(suites)
    families = []
    for key, family in FAMILIES.items():
        present = [m for m in family.members if hasattr(target, m)]
        if not present:
            members = " / ".join(family.members)
            families.append(FamilyResult(family, False, f"the target provides no {family.name} ({members} absent)"))
            continue
        result = FamilyResult(family, True)
        if key not in probed:
            result.checks = ["not probed: no selected suite needs it"]
            families.append(result)
            continue
        absent = [m for m in family.members if m not in present]
        if absent:
            result.problems.append(f"target {spec} has {', '.join(present)} but lacks {family.name} member: {', '.join(absent)}")
        else:
            try:
                result.checks = _probe(family.probe)(target, device)
            except ConformanceError as exc:
                result.problems += str(exc).splitlines()
            except Exception as exc:  # the target raised while being probed: that is its problem, in one line
                text = f"{type(exc).__name__}: {exc}".replace("\n", " | ")[:500]
                result.problems.append(f"{family.name} probe of {spec} raised {text}")
        families.append(result)
    return Conformance(spec, str(getattr(target, "name", "?")), problems, families, policies)


# ---------------------------------------------------------------------------------------------
# Helpers the family probes share
# ---------------------------------------------------------------------------------------------


class Checks:
    """Collects what a probe checked and what failed; `done()` returns the checks or raises one
    ConformanceError with a line per problem."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.checked: list[str] = []
        self.problems: list[str] = []

    def require(self, obj: Any, protocol: type, label: str) -> bool:
        missing = missing_members(obj, protocol)
        if missing:
            self.problems.append(f"{label} ({type(obj).__name__}) lacks {protocol.__name__} member: {', '.join(missing)}")
            return False
        return True

    def expect(self, ok: bool, problem: str, checked: str = "") -> bool:
        if ok:
            if checked:
                self.checked.append(checked)
        else:
            self.problems.append(f"{self.what}: {problem}")
        return ok

    def attempt(self, call: str, fn: Callable[[], Any]) -> Any:
        """Call `fn`; a raise is a problem naming `call` (and the call's result is None)."""
        try:
            return fn()
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}".replace("\n", " | ")[:300]
            self.problems.append(f"{self.what}: {call} raised {text}")
            return None

    def done(self) -> list[str]:
        if self.problems:
            raise ConformanceError("\n".join(self.problems))
        return self.checked


def shape_text(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} {list(shape)}" if shape is not None else type(value).__name__

"""The sensitivity catalogue: known-bad variants of the built-in target, one per defect of the seeds.

A mutant is one small run-time change (a monkeypatch of one named function, or an attribute set
on loaded modules), never an edit of shipped code. Each is reachable as a `--target` factory,
`parity.suites.ar.mutants:mutant_<name with _ for ->`, which applies the change in the process that loads
it and returns the serving target, so any suite can be pointed at it. Each entry says which
defect it stands for, which suite must kill it and, per lane, which tests of that suite to run at
which model size and dtype (`Kill`), or why the mutant cannot apply on that lane (`NotApplicable`:
an equivalent mutant at that configuration, reported as `not_applicable`, never as a pass).

Lanes are named by device: `cpu` (tiny fp32 models, the CPU graph stand-in, Inductor on CPU) and
`cuda` (real CUDA graphs and Inductor on the GPU). Mutants run at tiny size on both lanes unless
their entry says otherwise: the defects are structural (a baked branch, a stale buffer, a wrong
layer range), and tiny models show them through the same code paths as full-size ones.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from parity.target import FAMILIES

LANES = ("cpu", "cuda")


def lane_of(device: str) -> str:
    """The catalogue lane a run on `device` belongs to."""
    return "cuda" if device.startswith("cuda") else "cpu"


@dataclasses.dataclass(frozen=True)
class Kill:
    """The tests that must go red for a mutant on one lane, and the configuration they run at."""

    tests: tuple[str, ...]  # pytest arguments selecting the tests
    size: str = "tiny"
    dtype: str | None = None  # None: the lane's default dtype (fp32 on cpu, bf16 on cuda)
    why: str = ""  # why this selection (or configuration) differs from the other lane's, if it does
    tp: int = 1  # tensor-parallel ranks the selection runs at (a sharding mutant: 2); a run applies the mutants of its own tp

    @property
    def config(self) -> tuple[str, str | None, int]:
        return self.size, self.dtype, self.tp


@dataclasses.dataclass(frozen=True)
class NotApplicable:
    """A mutant that cannot show on a lane (equivalent there), and why."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    defect: str
    suite: str
    target: str  # the --target spec that loads the mutant
    lanes: Mapping[str, Kill | NotApplicable]
    family: str = ""  # what it breaks (docs/mutants.md groups by it); "" = the family of its module
    # True: its change reaches what `parity/suites/sensitivity/isolation.py` cannot put back (torch
    # itself, state mutated in place), so it runs in a process of its own, never in a batch
    isolated: bool = False
    # The stage its defect sits in (a site of the family's stage vocabulary, docs/localise.md), which
    # a localisation must name; `stage_note`: why the chain cannot name it (with a stage: a known
    # miss) or why the defect sits in no one stage (without one)
    stage: str = ""
    stage_note: str = ""

    @property
    def group(self) -> str:
        """The family the mutant is listed under: its own, else its module's (`parity.suites.<family>.mutants`)."""
        if self.family:
            return self.family
        module = self.target.split(":", 1)[0].split(".")
        return FAMILY_TITLES.get(module[2] if len(module) > 3 and module[:2] == ["parity", "suites"] else "", "other")

    def on(self, lane: str) -> Kill | NotApplicable:
        """The mutant's kill selection on `lane` (`cpu` or `cuda`)."""
        if lane not in self.lanes:
            raise KeyError(f"mutant {self.name!r} declares no selection for lane {lane!r} (lanes: {sorted(self.lanes)})")
        return self.lanes[lane]

    @property
    def tests(self) -> tuple[str, ...]:
        """The CPU lane's selection (the one a reader runs by hand first)."""
        kill = self.on("cpu")
        return kill.tests if isinstance(kill, Kill) else ()

    @property
    def factory(self) -> str:
        return self.target


CATALOGUE: dict[str, Mutant] = {}
_APPLY: dict[str, Callable[[], None]] = {}


def _lanes(
    tests: tuple[str, ...], cuda: tuple[str, ...] | Kill | NotApplicable | None, tp: int = 1
) -> dict[str, Kill | NotApplicable]:
    """CPU lane: `tests` at tiny fp32. CUDA lane: the same tests unless `cuda` says otherwise."""
    if cuda is None:
        gpu: Kill | NotApplicable = Kill(tests, tp=tp)
    elif isinstance(cuda, (Kill, NotApplicable)):
        gpu = cuda
    else:
        gpu = Kill(tuple(cuda), tp=tp)
    return {"cpu": Kill(tests, tp=tp), "cuda": gpu}


def applies_at(mutant: Mutant, lane: str, tp: int) -> bool:
    """Whether a run at tensor-parallel size `tp` checks `mutant`: a sharding mutant's selection
    runs sharded, every other one in one process (and a lane's n/a entry is always reported)."""
    kill = mutant.on(lane)
    return (kill.tp if isinstance(kill, Kill) else 1) == tp


def mutant(
    name: str,
    *,
    defect: str,
    suite: str,
    tests: tuple[str, ...],
    cuda: tuple[str, ...] | Kill | NotApplicable | None = None,
    family: str = "",
    isolated: bool = False,
    stage: str = "",
    stage_note: str = "",
    tp: int = 1,
) -> Callable:
    """Register the decorated function as the run-time change of mutant `name` (`tp`: the
    tensor-parallel size its selection runs at; a sharded session is a process of its own)."""

    def register(apply: Callable[[], None]) -> Callable[[], None]:
        spec = f"{apply.__module__}:mutant_{name.replace('-', '_')}"
        lanes = _lanes(tests, cuda, tp)
        CATALOGUE[name] = Mutant(name, defect, suite, spec, lanes, family, isolated or tp > 1, stage, stage_note)
        _APPLY[name] = apply
        return apply

    return register


def external(
    name: str,
    *,
    defect: str,
    suite: str,
    tests: tuple[str, ...],
    target: str,
    cuda: tuple[str, ...] | Kill | NotApplicable | None = None,
    family: str = "",
    isolated: bool = False,
    stage: str = "",
    stage_note: str = "",
) -> None:
    """A mutant whose factory lives in a family module (parity/suites/dit/mutants.py, parity/suites/routing/mutants.py)."""
    CATALOGUE[name] = Mutant(name, defect, suite, target, _lanes(tests, cuda), family, isolated, stage, stage_note)


def serving_target_with(name: str, tp: Any = None) -> Any:
    """Apply mutant `name`'s run-time change in this process and return the built-in target (this
    rank's sharded one in a tensor-parallel run)."""
    _APPLY[name]()
    from parity.target import resolve_target

    return resolve_target("serving", tp=tp)


def factory_lookup(module: str) -> Callable[[str], Callable[[], Any]]:
    """A module `__getattr__` that serves `mutant_<name>` factories for the mutants registered in
    `module` (so `--target <module>:mutant_<name>` resolves)."""

    def __getattr__(attribute: str) -> Callable[[], Any]:
        if attribute.startswith("mutant_"):
            name = attribute.removeprefix("mutant_").replace("_", "-")
            if name in CATALOGUE and CATALOGUE[name].target.startswith(f"{module}:"):
                return functools.partial(serving_target_with, name)
        raise AttributeError(f"module {module!r} has no attribute {attribute!r}")

    return __getattr__


# The catalogue's groups in the order docs/mutants.md lists them (suites package -> title): the
# model families (parity.target.FAMILIES), then the harness's own parts.
FAMILY_TITLES = {
    **{key: family.title for key, family in FAMILIES.items()},
    "runners": "runners and capture",
    "selfcheck": "report and review",
}
RUNNERS = FAMILY_TITLES["runners"]

# Each model family's mutants live in its suites package, the report's in selfcheck's.
FAMILY_MODULES = (*(f"parity.suites.{key}.mutants" for key in FAMILIES), "parity.suites.selfcheck.mutants")


# Sections of docs/mutants.md after the catalogue: the planted catalogue (any target's mutants),
# whose module's `markdown()` writes its section.
SECTION_MODULES = ("parity.suites.sensitivity.planted",)


def all_mutants() -> dict[str, Mutant]:
    """The whole catalogue: every family module registers its mutants when imported."""
    for name in FAMILY_MODULES:
        importlib.import_module(name)
    return CATALOGUE


def patch(module_name: str, attribute: str, replacement: Any) -> None:
    """Replace `module.attribute` in this process (a mutant's run-time change)."""
    setattr(importlib.import_module(module_name), attribute, replacement)


# ---------------------------------------------------------------------------------------------
# docs/mutants.md, generated: `python -m parity.suites.sensitivity.catalogue --markdown`
# ---------------------------------------------------------------------------------------------

MARKDOWN_HEADER = """# The mutant catalogue

<!-- Generated from the catalogue by `python -m parity.suites.sensitivity.catalogue --markdown > docs/mutants.md`;
tests/repo/test_mutants_doc.py fails when this file is stale. Edit the entries in parity/suites/<family>/mutants.py. -->

Known-bad variants of the built-in target, each one small run-time change standing for a defect a
port (or a parity harness) shipped. The sensitivity suite (`parity/suites/sensitivity/test_sensitivity.py`)
runs each one's selection for the run's lane in an isolated pytest session and records it killed
when a gate row of the named suite fails; the correct target must raise no alarm on the same
selections under other seeds. `parity run` prints the score per suite. Load one by hand with
`--parity-target <target>` (`parity run --target <target>`).

How the sessions run: several per process. A serial run starts them all at its first test (on CUDA
once its numerics tests have ended, docs/suites.md §3), in
batches of about equal cost forked from one pre-imported server (`parity/suites/sensitivity/runs.py`);
a batch runs its sessions one after the other, and between two of them puts back every module
attribute the previous mutant patched and drops the models and compiled frames it built
(`parity/suites/sensitivity/isolation.py`). A mutant whose change that cannot undo is marked
`isolated` and gets a process of its own. A batch runs its control seeds last, so a green control
is also evidence that the isolation held. The server freezes what it preloaded before it forks
(`gc.freeze`), so a session's garbage collections scan only what the session made: on the 2-core
CPU machine a tiny mutant's session costs its tests and about 0.3 s (1.3 s before the freeze,
about 2 s more as a process of its own); a control seed, whose `cpu_graph` recordings got
cheaper too (docs/performance.md §1), about 20 s (36 s).

Control seeds: every run checks the correct target under seeds 1, 2, 3 (`CONTROL_SEEDS` in
`parity/suites/sensitivity/runs.py`). Some selections (`SEED_INDEPENDENT`) gate only on counts of
events that code paths decide, never tensor values: the recompile suites' compiles, graph breaks
and eager fallbacks of fullgraph traces (Dynamo guards on shapes, dtypes and Python values), and
the missing-probe warnings over forwards of fixed ids. A seed cannot change them. When the run
itself runs them on the correct target at the kill configuration (the CPU lane's `parity run`),
those rows are their control and every control seed leaves them out; otherwise (a `--suite
sensitivity` run, the CUDA lane's full-size run) the first control seed runs them. Seeds 1-5 were checked once on
the cpu lane on 2026-12-02, when the catalogue held 40 of today's mutants: 287 cases per seed, no alarm,
all 40 killed. The catalogue has grown since; the count below is today's.

Lanes: `cpu` runs tiny fp32 models with the CPU graph stand-in; `cuda` runs real CUDA graphs
(tiny models, bf16 unless the entry says otherwise). `n/a` is an equivalent mutant on that lane,
with its reason: never counted as killed.
"""


def _selection(kill: Kill | NotApplicable) -> str:
    if isinstance(kill, NotApplicable):
        return f"n/a: {kill.reason}"
    text = " ".join(f'"{part}"' if " " in part else part for part in kill.tests)
    config = [kill.size] + ([kill.dtype] if kill.dtype else []) + ([f"tp {kill.tp}"] if kill.tp > 1 else [])
    out = f"`{text}` ({' '.join(config)})"
    return out + (f": {kill.why}" if kill.why else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(catalogue: Mapping[str, Mutant] | None = None) -> str:
    """docs/mutants.md: every mutant grouped by family, with its defect, the suite that must kill it
    and each lane's selection; a count per family and per suite."""
    catalogue = all_mutants() if catalogue is None else catalogue
    order = list(FAMILY_TITLES.values())
    groups: dict[str, list[Mutant]] = {}
    for entry in catalogue.values():
        groups.setdefault(entry.group, []).append(entry)
    families = sorted(groups, key=lambda g: (order.index(g) if g in order else len(order), g))
    suites: dict[str, int] = {}
    for entry in catalogue.values():
        suites[entry.suite] = suites.get(entry.suite, 0) + 1
    lines = [MARKDOWN_HEADER]
    counts = ", ".join(f"{family} {len(groups[family])}" for family in families)
    per_suite = ", ".join(f"`{suite}` {n}" for suite, n in sorted(suites.items()))
    lines.append(f"{len(catalogue)} mutants: {counts}. Killed by suite: {per_suite}.\n")
    for family in families:
        lines.append(f"## {family}\n")
        lines.append("| mutant | defect | killed by | cpu lane | cuda lane | target |")
        lines.append("|---|---|---|---|---|---|")
        for entry in groups[family]:
            cells = (
                f"`{entry.name}`",
                entry.defect,
                f"`{entry.suite}`",
                _selection(entry.on("cpu")),
                _selection(entry.on("cuda")),
                f"`{entry.target}`",
            )
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    for module in SECTION_MODULES:  # by name, as the family modules: they import this one
        lines.append(importlib.import_module(module).markdown())
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m parity.suites.sensitivity.catalogue", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print docs/mutants.md (the catalogue as markdown)")
    arguments = parser.parse_args()
    if not arguments.markdown:
        parser.error("nothing to do: pass --markdown")
    # Run as a script this file is `__main__`, a second module object: the family modules register
    # into the imported `parity.suites.sensitivity.catalogue`, so ask that one.
    from parity.suites.sensitivity import catalogue

    sys.stdout.write(catalogue.markdown())

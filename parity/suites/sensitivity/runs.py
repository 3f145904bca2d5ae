"""The sensitivity suite's child sessions: what each runs, and running many of them in few processes.

Each mutant's kill selection and each correct-target control is an isolated pytest session. The
sessions run in processes forked from one pre-imported server (`sessions.PytestForkServer`), several
per process: a batch runs its sessions one after the other, and between two of them
`isolation.isolated_session` puts back every module attribute the previous session's mutant
patched and drops the models and compiled frames it built. A fresh process per session cost about
2 s each (collection, imports, model builds); in a batch a session costs what its tests cost. A
mutant whose change cannot be undone that way (one marked `isolated` in the catalogue) gets a
process of its own. Each batch that holds a control runs it last: a control that stays green after
the mutants of its batch is evidence that the isolation held.

In a serial run on a machine with cores to spare, `parity/suites/conftest.py` starts every selected
session at the run's first test (`start_early`), in batches balanced by an estimate of their cost:
on all cores but one beside the other suites (on CUDA they share the GPU with it), and on all of
them once the sensitivity tests are reached (`ChildSessions.all_cores`); each sensitivity test
collects its own result. Under xdist (the CPU lane's `-n 2`) each worker runs its tests' sessions
one at a time: its sibling worker uses the other core.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from parity.env import PROJECT_ROOT
from parity.observe.progress import stall_limit
from parity.plugin.options import plugin_load_args
from parity.report import read_results
from parity.suites.sensitivity import planted as _planted  # noqa: F401 - registers the planted catalogue
from parity.suites.sensitivity.catalogue import Kill, NotApplicable, all_mutants, lane_of
from parity.suites.sensitivity.plant import PLANTED, PLANTED_ON_ENV, lane_kill, not_applicable
from parity.suites.sensitivity.sessions import DEFAULT_PRELOAD, PytestForkServer

CATALOGUE = all_mutants()
CONTROL_SEEDS = (1, 2, 3)
# Selections whose every gate row counts events decided by code paths, shapes and Python values,
# never by tensor values: compiles, graph breaks and eager fallbacks of fullgraph traces (Dynamo
# guards on shapes, dtypes and Python values, and a fullgraph trace that read a tensor's value would
# fail, not branch), and warnings of the missing capture probe over forwards of fixed ids. Another
# seed (other weights) cannot change one of these rows. The control seeds leave them out when the
# run itself runs them on the correct target at the kill configuration (the CPU lane's `parity
# run`: those rows are their control, at the run's seed); otherwise the first control seed runs
# them (docs/mutants.md, "Control seeds"). `(file, -k expression or None for the whole file)`.
SEED_INDEPENDENT = (
    ("parity/suites/ar/test_recompiles.py", None),
    ("parity/suites/dit/test_recompiles.py", None),
    ("parity/suites/ar/test_fail_closed_capture.py", "missing_probe"),
)
SEED_INDEPENDENT_FILES = tuple(file for file, expression in SEED_INDEPENDENT if expression is None)
# The suites' own modules as well: each child then starts with its collection imports done, and
# every module a mutant may patch is loaded before the first snapshot (`isolation.preload`).
PRELOAD = (
    *DEFAULT_PRELOAD,
    "parity.suites.conftest",
    "parity.suites.sensitivity.catalogue",
    "parity.suites.sensitivity.isolation:preload",
)
ISOLATION = "parity.suites.sensitivity.isolation:isolated_session"
EARLY_SESSIONS = pytest.StashKey["ChildSessions"]()
SENSITIVITY_MODULE = "test_sensitivity.py"
PLANTED_MODULE = "test_target_mutants.py"  # the planted catalogue (`plant.py`): any target
CATALOGUE_MODULES = (SENSITIVITY_MODULE, PLANTED_MODULE)
# Rough seconds of one session on the 2-core CPU machine, to balance batches (docs/mutants.md): a
# control session, a mutant whose selection compiles (a recompile lattice, Inductor) or not, and a
# planted mutant (it loads a transformed copy of the checkpoint before its tests). Measured before
# the server froze its preload; all of them are about half that now, and only their ratios matter.
CONTROL_COST, COMPILING_COST, MUTANT_COST, PLANTED_COST = 40.0, 15.0, 1.0, 3.0


def parallel_sessions(device: str = "cpu") -> int:
    """How many child sessions to run at once when this is the only test process (one under xdist:
    the sibling workers use the other cores): the cores this process may use, at most 4 on the CPU
    lane; on CUDA half of them, at most 8. A CUDA child builds tiny models (a CUDA context and well
    under 1 GiB each beside the parent's full-size models) and is bound by its Python overhead, not
    by the GPU: four at once ran the H200 lane's suite in 280 s, one at a time did not finish two
    thirds of it in 300 s, and every CUDA mutant now has a process of its own (`mutant_session`).
    PARITY_SENSITIVITY_JOBS overrides it."""
    override = os.environ.get("PARITY_SENSITIVITY_JOBS")
    if override:
        return max(1, int(override))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return 1
    cores = len(os.sched_getaffinity(0))
    if lane_of(device) == "cuda":
        return max(1, min(cores // 2, 8))
    return max(1, min(cores, 4))


@dataclasses.dataclass(frozen=True)
class Session:
    """One isolated pytest session: what it runs, at which configuration, where its rows go."""

    key: tuple
    args: list[str]
    kill: Kill
    out: Path
    cost: float
    isolated: bool = False

    @property
    def is_control(self) -> bool:
        return self.key[0] in ("control", "planted-control")


def run_covers_seed_independent(items: Sequence[Any], settings: Any, *, root: Path = PROJECT_ROOT) -> bool:
    """Whether this run itself runs every seed-independent selection (`SEED_INDEPENDENT`) on the
    correct target at the configuration the lane's mutants are killed at, so the controls can leave
    them out. `items` are the run's selected pytest items; files are resolved against `root`."""
    from parity.suites.sensitivity.selection import picks

    if settings.target != "serving":
        return False
    lane = lane_of(settings.device)
    configs = {
        kill.config
        for mutant in CATALOGUE.values()
        if isinstance(kill := mutant.on(lane), Kill)
        and kill.tp == settings.tp
        and _seed_independent(kill.tests[0], _expression(kill.tests))
    }
    run_dtype = None if settings.dtype == _lane_dtype(lane) else settings.dtype
    if configs - {(settings.size, run_dtype, settings.tp)}:
        return False
    return all(
        any(picks(item, [((root / file).resolve(), expression)]) for item in items) for file, expression in SEED_INDEPENDENT
    )


def _expression(tests: Sequence[str]) -> str | None:
    return tests[list(tests).index("-k") + 1] if "-k" in tests else None


def _seed_independent(path: str, expression: str | None) -> bool:
    return (path, None) in SEED_INDEPENDENT or (path, expression) in SEED_INDEPENDENT


def _lane_dtype(lane: str) -> str:
    return "fp32" if lane == "cpu" else "bf16"


class ChildSessions:
    """The run's isolated pytest sessions on one pre-imported fork server (`parallel` at a time).
    Sessions started up front (in batches) are collected by key; a test whose session was not
    started runs it alone when it asks for the result."""

    def __init__(
        self,
        server: PytestForkServer,
        settings: Any,
        parallel: int,
        *,
        covered: bool = False,
        families: frozenset[str] = frozenset(),
    ) -> None:
        self.server, self.settings, self.parallel = server, settings, parallel
        self.covered = covered  # the run runs the seed-independent files itself (controls leave them out)
        self.families = families  # the model families the run's target provides (where planted mutants apply)
        self.started: dict[tuple, tuple[Any, int, Path]] = {}
        self.deferred: AfterNumerics | None = None  # sessions planned but not started yet (`start_early`)

    @classmethod
    @contextmanager
    def open(
        cls,
        settings: Any,
        parallel: int,
        jobs: int | None = None,
        *,
        covered: bool = False,
        families: frozenset[str] = frozenset(),
    ) -> Iterator[ChildSessions]:
        """A server running `jobs` sessions at once (default `parallel`) until `all_cores`."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
        env["PARITY_SENSITIVITY_JOBS"] = "1"  # a child session never starts sessions of its own early
        env[PLANTED_ON_ENV] = settings.target  # the target every planted mutant wraps (`plant.py`)
        with PytestForkServer(cwd=PROJECT_ROOT, env=env, preload=PRELOAD, jobs=jobs or parallel) as server:
            yield cls(server, settings, parallel, covered=covered, families=families)

    def all_cores(self) -> None:
        """The run's own tests now only wait for these sessions: run `parallel` of them at once
        (and start the planned ones now if they were waiting for the numerics tests)."""
        if self.deferred is not None:
            self.deferred.start()
        if self.server.jobs != self.parallel:
            self.server.set_jobs(self.parallel)

    def argv(self, args: list[str], kill: Kill, out: Path) -> list[str]:
        argv = [
            *plugin_load_args(),  # a checkout run without installing (the GPU box) has no entry point
            *args,
            "-p",
            "no:cacheprovider",
            "--parity-report-dir",
            str(out),
            "--parity-run-id",
            "child",
            "--parity-device",
            self.settings.device,
            "--parity-size",
            kill.size,
            "--parity-no-summary",
            "-q",
        ]
        argv += ["--parity-tp", str(kill.tp)] if kill.tp > 1 else []
        return argv + (["--parity-dtype", kill.dtype] if kill.dtype else [])

    def control_sessions(self, seed: int, out: Path) -> list[Session]:
        """The control of `seed`: one session per kill configuration."""
        lane = lane_of(self.settings.device)
        sessions = []
        selections = control_selections(lane, seed, covered=self.covered, tp=self.settings.tp)
        for index, (config, selection) in enumerate(selections.items()):
            key = ("control", seed, index)
            sessions.append(Session(key, control_args(selection, seed), config, out / f"config-{index}", CONTROL_COST))
        return sessions

    def mutant_session(self, name: str, out: Path) -> Session | None:
        mutant = CATALOGUE[name]
        kill = mutant.on(lane_of(self.settings.device))
        if not isinstance(kill, Kill):
            return None
        compiling = _seed_independent(kill.tests[0], _expression(kill.tests)) or "compiled" in " ".join(kill.tests[1:]).replace(
            "not compiled", ""
        )
        cost = COMPILING_COST if compiling else MUTANT_COST
        # On CUDA a mutant's failed graph capture poisons the process it ran in (the RNG refuses to
        # work afterwards: docs/capture-and-compile.md §1), and several mutants make a capture fail on
        # purpose: every CUDA mutant gets a process of its own (a control after one errored on the H200).
        isolated = mutant.isolated or lane_of(self.settings.device) == "cuda"
        return Session(("mutant", name), mutant_args(name, kill), kill, out, cost, isolated=isolated)

    def planted_session(self, name: str, out: Path) -> Session | None:
        """The session of planted mutant `name` against the run's target, at the run's
        tensor-parallel size; None when it does not apply (`plant.not_applicable`)."""
        entry, settings = PLANTED[name], self.settings
        if not_applicable(entry, lane_of(settings.device), self.families) is not None:
            return None
        kill = lane_kill(entry, settings.device, settings.tp)
        assert isinstance(kill, Kill)
        isolated = kill.tp > 1 or lane_of(settings.device) == "cuda"  # as the built-in mutants' (`mutant_session`)
        return Session(("planted", name), planted_args(name, kill, settings), kill, out, PLANTED_COST, isolated=isolated)

    def planted_control_sessions(self, seed: int, out: Path) -> list[Session]:
        """The correct target under `seed` on every selection of the planted mutants that apply to
        it, one session per configuration."""
        settings, lane = self.settings, lane_of(self.settings.device)
        kills = [
            lane_kill(entry, settings.device, settings.tp)
            for entry in PLANTED.values()
            if not_applicable(entry, lane, self.families) is None
        ]
        sessions = []
        for index, (config, selection) in enumerate(selection_args([k for k in kills if isinstance(k, Kill)]).items()):
            args = [*selection, "--parity-target", settings.target, "--parity-seed", str(seed), *layout_args(settings)]
            key = ("planted-control", seed, index)
            sessions.append(Session(key, args, config, out / f"config-{index}", CONTROL_COST, isolated=config.tp > 1))
        return sessions

    def start(self, sessions: Sequence[Session]) -> None:
        """Submit `sessions` as one batch, in this order, isolated from each other."""
        for session in sessions:
            session.out.mkdir(parents=True, exist_ok=True)
        future = self.server.submit_batch(
            [(self.argv(s.args, s.kill, s.out), s.out / "child.log") for s in sessions],
            isolation=ISOLATION,
            stall=stall_limit(),  # no time limit: stopped when its sessions stop writing (docs/cli.md §9)
            watch=[s.out for s in sessions],
        )
        for index, session in enumerate(sessions):
            self.started[session.key] = (future, index, session.out)

    def start_batches(self, sessions: Sequence[Session]) -> int:
        """Start `sessions` in batches of about equal cost (isolated ones alone), the costliest
        batches first; returns how many sessions were started."""
        for session in sessions:
            if session.isolated:
                self.start([session])
        shared = [s for s in sessions if not s.isolated]
        for batch in balanced_batches(shared, 2 * self.parallel):
            self.start(batch)
        return len(sessions)

    def result(self, session: Session) -> tuple[int, pd.DataFrame | None, str]:
        """The session's exit code, its rows and the tail of its log (started now if it was not)."""
        if session.key not in self.started:
            self.start([session])
        future, index, out = self.started.pop(session.key)
        code = future.result()[index]
        results = out / "child" / "results.csv"
        rows = read_results(results.parent) if results.exists() else None
        log = out / "child.log"
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        return code, rows, " | ".join(lines[-3:])

    def planned(self, items: Sequence[pytest.Item], tmp_path_factory: pytest.TempPathFactory) -> list[Session]:
        """The sessions of the selected sensitivity tests among `items`."""
        mine = [item for item in items if item.path.name in CATALOGUE_MODULES and hasattr(item, "callspec")]
        sessions: list[Session] = []
        for item in mine:
            params, planted = item.callspec.params, item.path.name == PLANTED_MODULE
            if "seed" in params:
                controls = self.planted_control_sessions if planted else self.control_sessions
                sessions += controls(params["seed"], tmp_path_factory.mktemp(f"control-{params['seed']}"))
            elif "name" in params:
                make = self.planted_session if planted else self.mutant_session
                session = make(params["name"], tmp_path_factory.mktemp(f"mutant-{params['name']}"))
                if session is not None:
                    sessions.append(session)
        return sessions

    def start_selected(self, items: Sequence[pytest.Item], tmp_path_factory: pytest.TempPathFactory) -> int:
        """Start the sessions of the selected sensitivity tests among `items`; returns how many."""
        return self.start_batches(self.planned(items, tmp_path_factory))


def balanced_batches(sessions: Sequence[Session], count: int) -> list[list[Session]]:
    """`sessions` split into at most `count` batches of about equal estimated cost (the costliest
    first, each to the lightest batch); inside a batch the mutants run first, the controls last."""
    batches: list[list[Session]] = [[] for _ in range(max(1, count))]
    loads = [0.0] * len(batches)
    for session in sorted(sessions, key=lambda s: -s.cost):
        lightest = loads.index(min(loads))
        batches[lightest].append(session)
        loads[lightest] += session.cost
    ordered = [
        sorted(batch, key=lambda s: (s.is_control, s.cost)) for batch, _ in sorted(zip(batches, loads), key=lambda b: -b[1])
    ]
    return [batch for batch in ordered if batch]


@contextmanager
def start_early(session: pytest.Session, settings: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """In a serial run with cores to spare and sensitivity tests selected, start their sessions
    beside the other suites on all cores but one and leave them in the config's stash for the
    suite. Leaving the block stops the server: sessions nobody collected (an interrupted or `-x`
    run) are killed. On the CPU lane they start at the run's first test. On CUDA they start once
    the run's last numerics test has ended (`AfterNumerics`): the children's tiny models share the
    GPU and the host's cores with the run's full-size ones, and the layer-by-layer numerics cases
    (the lane's longest tests, bound by the fp64 golden on the host) took 208 s of the H200 lane
    beside them; started only after every other suite, the sessions alone took 280 s (four at a
    time), which did not leave the lane inside 10 minutes."""
    parallel = parallel_sessions(settings.device)
    selected = [
        item
        for item in session.items
        if item.path.name == PLANTED_MODULE or (item.path.name == SENSITIVITY_MODULE and settings.target == "serving")
    ]
    if parallel < 2 or not selected:
        yield
        return
    covered = run_covers_seed_independent(session.items, settings)
    families = run_families(session.config) if any(item.path.name == PLANTED_MODULE for item in selected) else frozenset()
    with ChildSessions.open(settings, parallel, jobs=parallel - 1, covered=covered, families=families) as children:
        session.config.stash[EARLY_SESSIONS] = children
        last_numerics = _last_numerics(session.items) if lane_of(settings.device) == "cuda" else None
        deferred = children.deferred = AfterNumerics(children, selected, tmp_path_factory, last_numerics)
        if last_numerics is None:
            deferred.start()
        else:
            session.config.pluginmanager.register(deferred, "parity-sessions-after-numerics")
        try:
            yield
        finally:
            if last_numerics is not None:
                session.config.pluginmanager.unregister(deferred)
            del session.config.stash[EARLY_SESSIONS]


def _last_numerics(items: Sequence[pytest.Item]) -> str | None:
    """The node id of the run's last numerics test (None when it runs none)."""
    from parity.plugin.lanes import suite_of

    numerics = [item.nodeid for item in items if suite_of(item) == "numerics"]
    return numerics[-1] if numerics else None


class AfterNumerics:
    """Starts the selected sessions once (`start`): when the test `after` has ended (a pytest
    plugin object: `pytest_runtest_logfinish`), or earlier when the sensitivity tests are reached
    first (`ChildSessions.all_cores`)."""

    def __init__(
        self,
        children: ChildSessions,
        selected: Sequence[pytest.Item],
        tmp_path_factory: pytest.TempPathFactory,
        after: str | None,
    ) -> None:
        self.children, self.selected, self.tmp_path_factory, self.after = children, selected, tmp_path_factory, after
        self.started = False

    def start(self) -> None:
        if not self.started:
            self.started = True
            self.children.start_selected(self.selected, self.tmp_path_factory)

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        if nodeid == self.after:
            self.start()


def run_families(config: pytest.Config) -> frozenset[str]:
    """The model families the session's target provides (none when it does not resolve: the plugin
    reports that once, up front)."""
    from parity.plugin.session import session_target
    from parity.suites.sensitivity.plant import provided_families
    from parity.target import TargetError

    try:
        return provided_families(session_target(config))
    except TargetError:
        return frozenset()


def layout_args(settings: Any) -> list[str]:
    """The run's checkpoint layout, for a session of the run's own target (its loader may read only one)."""
    layout = getattr(settings, "checkpoint_layout", "parity")
    return ["--parity-checkpoint-layout", layout] if layout != "parity" else []


def planted_args(name: str, kill: Kill, settings: Any) -> list[str]:
    return [*kill.tests, "--parity-target", PLANTED[name].target, *layout_args(settings), "-x"]


def mutant_args(name: str, kill: Kill) -> list[str]:
    return [*kill.tests, "--parity-target", CATALOGUE[name].target, "-x"]


def control_args(selection: list[str], seed: int) -> list[str]:
    return [*selection, "--parity-target", "serving", "--parity-seed", str(seed)]


def control_selections(lane: str, seed: int = CONTROL_SEEDS[0], *, covered: bool = False, tp: int = 1) -> dict[Kill, list[str]]:
    """Every test the lane's mutants are checked with, one pytest selection per configuration
    (size, dtype): the files, and each mutant's `-k` applied to its own file only
    (`parity/suites/sensitivity/selection.py`). The seed-independent selections
    (`SEED_INDEPENDENT`) only in the first seed's selection, and not at all when the run `covered`
    them itself (`run_covers_seed_independent`)."""
    kills = []
    for mutant in CATALOGUE.values():
        kill = mutant.on(lane)
        if isinstance(kill, NotApplicable) or kill.tp != tp:
            continue
        if (covered or seed != CONTROL_SEEDS[0]) and _seed_independent(kill.tests[0], _expression(kill.tests)):
            continue
        kills.append(kill)
    return selection_args(kills)


def selection_args(kills: Sequence[Kill]) -> dict[Kill, list[str]]:
    """The pytest selection of every test `kills` select, one per configuration (size, dtype, tp):
    the files, and each `-k` applied to its own file only (`selection.py`)."""
    groups: dict[tuple[str, str | None, int], tuple[list[str], list[tuple[str, str | None]]]] = {}
    for kill in kills:
        path = kill.tests[0]
        expression = _expression(kill.tests)
        files, selections = groups.setdefault(kill.config, ([], []))
        files.append(path)
        if (path, expression) not in selections:
            selections.append((path, expression))
    return {
        Kill((), size=size, dtype=dtype, tp=ranks): [
            *dict.fromkeys(files),
            "-p",
            "parity.suites.sensitivity.selection",
            "--kill-selections",
            json.dumps(selections),
        ]
        for (size, dtype, ranks), (files, selections) in groups.items()
    }

"""The sensitivity suite's child sessions: what each runs, and running several at once.

Each mutant's kill selection and each correct-target control is an isolated pytest session, forked
from one pre-imported server (`sessions.PytestForkServer`). In a serial run on a machine with
cores to spare, `parity/suites/conftest.py` starts every selected session at the run's first test
(`start_early`): they run on the spare cores beside the other suites (one core stays for the run's
own tests; on CUDA they share the GPU with it), and on all of them once the sensitivity tests are
reached (`ChildSessions.all_cores`);
each sensitivity test collects its own result. Under xdist (the CPU lane's `-n 2`) each worker
runs its tests' sessions one at a time: its sibling worker uses the other core.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from parity.env import PROJECT_ROOT
from parity.plugin.options import plugin_load_args
from parity.report import read_results
from parity.suites.sensitivity.catalogue import Kill, NotApplicable, all_mutants, lane_of
from parity.suites.sensitivity.sessions import DEFAULT_PRELOAD, PytestForkServer

CATALOGUE = all_mutants()
CONTROL_SEEDS = (1, 2, 3)
# Files whose every gate row is a count of a fullgraph trace (compiles, graph breaks, eager
# fallbacks, compiled block modules): Dynamo guards on shapes, strides, dtypes and Python values,
# never on tensor values, and a fullgraph trace that read a tensor's value would fail, not branch,
# so another seed cannot change one of these rows. Only the first control seed runs them
# (docs/mutants.md, "Control seeds"); they were about 40% of a control session's time on the CPU.
SEED_INDEPENDENT_FILES = ("parity/suites/ar/test_recompiles.py", "parity/suites/dit/test_recompiles.py")
CHILD_TIMEOUT_S = 900
# The suites' own modules as well: each child then starts with its collection imports done.
PRELOAD = (*DEFAULT_PRELOAD, "parity.suites.conftest", "parity.suites.sensitivity.catalogue")
EARLY_SESSIONS = pytest.StashKey["ChildSessions"]()
SENSITIVITY_MODULE = "test_sensitivity.py"


def parallel_sessions(device: str = "cpu") -> int:
    """How many child sessions to run at once: the cores this process may use (at most 4) when it is
    the only test process; one under xdist (the sibling workers use the other cores). On CUDA the
    children build tiny models (a CUDA context and well under 1 GiB each beside the parent's
    full-size models): four at once ran the H200 lane's suite in 280 s, one at a time did not finish
    two thirds of it in 300 s. PARITY_SENSITIVITY_JOBS overrides it."""
    override = os.environ.get("PARITY_SENSITIVITY_JOBS")
    if override:
        return max(1, int(override))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), 4))


class ChildSessions:
    """The run's isolated pytest sessions on one pre-imported fork server (`parallel` at a time).
    Sessions started up front are collected by key; a test whose session was not started runs it
    when it asks for the result."""

    def __init__(self, server: PytestForkServer, settings: Any, parallel: int) -> None:
        self.server, self.settings, self.parallel = server, settings, parallel
        self.started: dict[tuple, tuple[Any, Path]] = {}

    @classmethod
    @contextmanager
    def open(cls, settings: Any, parallel: int, jobs: int | None = None) -> Iterator[ChildSessions]:
        """A server running `jobs` sessions at once (default `parallel`) until `all_cores`."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
        env["PARITY_SENSITIVITY_JOBS"] = "1"  # a child session never starts sessions of its own early
        with PytestForkServer(cwd=PROJECT_ROOT, env=env, preload=PRELOAD, jobs=jobs or parallel) as server:
            yield cls(server, settings, parallel)

    def all_cores(self) -> None:
        """The run's own tests now only wait for these sessions: run `parallel` of them at once."""
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
        return argv + (["--parity-dtype", kill.dtype] if kill.dtype else [])

    def start(self, key: tuple, args: list[str], kill: Kill, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        future = self.server.submit(self.argv(args, kill, out), out / "child.log", timeout=CHILD_TIMEOUT_S)
        self.started[key] = (future, out)

    def result(self, key: tuple, args: list[str], kill: Kill, out: Path) -> tuple[int, pd.DataFrame | None, str]:
        """The session's exit code, its rows and the tail of its log (started now if it was not)."""
        if key not in self.started:
            self.start(key, args, kill, out)
        future, out = self.started.pop(key)
        code = future.result()
        results = out / "child" / "results.csv"
        rows = read_results(results.parent) if results.exists() else None
        log = out / "child.log"
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        return code, rows, " | ".join(lines[-3:])

    def start_selected(self, items: Sequence[pytest.Item], tmp_path_factory: pytest.TempPathFactory) -> int:
        """Start the sessions of the selected sensitivity tests among `items`, the controls (the
        longest) first; returns how many were started."""
        lane = lane_of(self.settings.device)
        mine = [item for item in items if item.path.name == SENSITIVITY_MODULE and hasattr(item, "callspec")]
        seeds = [item.callspec.params["seed"] for item in mine if "seed" in item.callspec.params]
        names = [item.callspec.params["name"] for item in mine if "name" in item.callspec.params]
        before = len(self.started)
        for seed in seeds:
            for index, (config, selection) in enumerate(control_selections(lane, seed).items()):
                out = tmp_path_factory.mktemp(f"control-{seed}-{index}")
                self.start(("control", seed, index), control_args(selection, seed), config, out)
        for name in names:
            kill = CATALOGUE[name].on(lane)
            if isinstance(kill, Kill):
                self.start(("mutant", name), mutant_args(name, kill), kill, tmp_path_factory.mktemp(f"mutant-{name}"))
        return len(self.started) - before


@contextmanager
def start_early(session: pytest.Session, settings: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """In a serial run with cores to spare and sensitivity tests selected, start their sessions now
    on all cores but one (they run beside the other suites) and leave them in the config's
    stash for the suite. Leaving the block stops the server: sessions nobody collected (an
    interrupted or `-x` run) are killed. On CUDA the children's tiny models share the GPU with the
    run's full-size ones: started only after the other suites, the sessions alone took 280 s of the
    H200 lane (four at a time), which did not leave the lane inside 10 minutes."""
    parallel = parallel_sessions(settings.device)
    selected = [item for item in session.items if item.path.name == SENSITIVITY_MODULE]
    if parallel < 2 or not selected or settings.target != "serving":
        yield
        return
    with ChildSessions.open(settings, parallel, jobs=parallel - 1) as children:
        children.start_selected(selected, tmp_path_factory)
        session.config.stash[EARLY_SESSIONS] = children
        try:
            yield
        finally:
            del session.config.stash[EARLY_SESSIONS]


def mutant_args(name: str, kill: Kill) -> list[str]:
    return [*kill.tests, "--parity-target", CATALOGUE[name].target, "-x"]


def control_args(selection: list[str], seed: int) -> list[str]:
    return [*selection, "--parity-target", "serving", "--parity-seed", str(seed)]


def control_selections(lane: str, seed: int = CONTROL_SEEDS[0]) -> dict[Kill, list[str]]:
    """Every test the lane's mutants are checked with, one pytest selection per configuration
    (size, dtype): the files, and each mutant's `-k` applied to its own file only
    (`parity/suites/sensitivity/selection.py`). Seeds after the first leave out the
    seed-independent files (`SEED_INDEPENDENT_FILES`)."""
    groups: dict[tuple[str, str | None], tuple[list[str], list[tuple[str, str | None]]]] = {}
    for mutant in CATALOGUE.values():
        kill = mutant.on(lane)
        if isinstance(kill, NotApplicable):
            continue
        path, *rest = kill.tests
        if seed != CONTROL_SEEDS[0] and path in SEED_INDEPENDENT_FILES:
            continue
        files, selections = groups.setdefault(kill.config, ([], []))
        files.append(path)
        expression = rest[rest.index("-k") + 1] if "-k" in rest else None
        if (path, expression) not in selections:
            selections.append((path, expression))
    return {
        Kill((), size=size, dtype=dtype): [
            *dict.fromkeys(files),
            "-p",
            "parity.suites.sensitivity.selection",
            "--kill-selections",
            json.dumps(selections),
        ]
        for (size, dtype), (files, selections) in groups.items()
    }

"""Runs of `parity run` made once per test session and read by every test that needs one.

The suites are the expensive part of this repository's tests: a CPU-lane run of every suite,
sensitivity included, is minutes of Dynamo tracing and Inductor compiles. The tests that need a
run's rows (the review, baseline and page tests, the lane's own verdicts, the example engine's
checks) read one run per configuration instead of each making their own:

* a run is named by a `RunSpec` (its `parity run` arguments) and keyed by the tree it runs: the
  tracked files' contents, the torch version and the kernel-set variables, so a directory made
  by another tree is never read;
* the first test process that asks starts it (`start`, under a file lock in the session's shared
  temporary directory, so one xdist worker makes it and the others wait for it and read it); the
  tests of this directory start the session's runs as soon as collection is done
  (`tests/conftest.py`), so they run beside the other tests, and the tests reading them run last;
* a run that satisfies a larger request satisfies a smaller one: a test that needs every suite but
  sensitivity reads the full lane run when this session makes it, and makes the smaller run only
  when no full one is coming (the machine-sensitive tests under a second kernel set, `.ci/run`);
* a run has no time limit: it is stopped when nothing it writes (its output, its rows, its pytest
  temporary directory, where the mutant catalogue's sessions write) has changed for
  $PARITY_STALL_S seconds (`parity.observe.progress`; docs/cli.md §9), so a loaded machine makes it
  slow, never killed.

Tests change copies of a run (`copy_run`), never the run itself.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from parity.observe.progress import Stalled, wait_watched
from parity.report import CONTEXT_COLUMNS, RESULTS_FILE, ReportWriter
from tests.support.helpers import PROJECT_ROOT, default_signals, subprocess_env

# The report suites of a CPU-lane run (`parity run` with no --suite); `SUITES_BUT_SENSITIVITY` is the
# smallest run a review of every suite against the committed baseline needs.
ALL_SUITES = (
    "selfcheck",
    "expert_selection",
    "fail_closed_capture",
    "embedding_clamp",
    "recompiles",
    "numerics",
    "decode",
    "weight_coverage",
    "image",
    "sampler",
    "routing",
    "sensitivity",
)
WATCH_POLL_S = 5.0  # how often a shared run's directory is walked for progress (it holds thousands of files)
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "PARITY_CPU_THREADS")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One `parity run` configuration: a name, the target and the report suites it runs."""

    name: str
    target: str = "serving"
    suites: tuple[str, ...] = ALL_SUITES
    tp: int = 1
    mutants: bool = False  # `--mutants`: the planted catalogue's score on the target too
    shard: str = ""  # `--shard K/N`: one part of the selection (a shard covers no other run, nor is covered)
    quick: bool = False  # `--quick`: the quick lane's selection (covers no full run, nor is covered by one)

    def args(self) -> list[str]:
        selection = [] if self.suites == ALL_SUITES else [a for suite in self.suites for a in ("--suite", suite)]
        return [
            "--target",
            self.target,
            *selection,
            *(["--tp", str(self.tp)] if self.tp > 1 else []),
            *(["--shard", self.shard] if self.shard else []),
            *(["--mutants"] if self.mutants else []),
            *(["--quick"] if self.quick else []),
        ]

    def covers(self, other: RunSpec) -> bool:
        same = self.target == other.target and self.tp == other.tp and self.shard == other.shard and self.quick == other.quick
        return same and set(other.suites) <= set(self.suites) and (self.mutants or not other.mutants)


LANE = RunSpec("cpu-lane")
SUITES_BUT_SENSITIVITY = RunSpec("cpu-suites", suites=tuple(s for s in ALL_SUITES if s != "sensitivity"))
EXAMPLE = RunSpec(
    "example-engine",
    target="examples.engine_target.parity_target:make_target",
    suites=("expert_selection", "fail_closed_capture", "embedding_clamp", "recompiles", "numerics", "decode", "weight_coverage"),
)
# The reference through the door of any target: the quick lane (every suite but the mutant
# catalogue, on its smallest cases) shows each suite runs, passes and skips graph modes with the
# reference's reason; the full lane on the reference would be minutes of the truth against itself.
REFERENCE = RunSpec("reference", target="reference", suites=tuple(s for s in ALL_SUITES if s != "sensitivity"), quick=True)
# The second example through the plain door: `parity run --target <it> --mutants`, no suite named
# (CI's score of the planted catalogue on a target other than the built-in one).
MINIMAL = RunSpec("minimal-ar", target="examples.minimal_target.parity_target:make_target", mutants=True)
# The tensor-parallel lane: the built-in target sharded over 2 ranks (gloo), every suite (the AR ones
# run; the sensitivity suite holds the sharding mutants), and the example engine's own TP=2 variant.
TP2 = RunSpec("cpu-lane-tp2", tp=2)
# The example engine's own TP=2 variant against the same selection in one process, both in the
# quick lane (every AR suite, eager, the graph stand-in and compiles traced without code
# generation): the comparison is of the sharded engine with the unsharded one, row for row; the
# full AR suites at TP=2 (Inductor included) are the built-in target's TP=2 run above.
EXAMPLE_QUICK = dataclasses.replace(EXAMPLE, name="example-engine-quick", quick=True)
EXAMPLE_TP2 = dataclasses.replace(EXAMPLE_QUICK, name="example-engine-quick-tp2", tp=2)
# The quick lane in two shards, as two machines of a CI matrix would run it, and on one machine
# (merged and reviewed against it in tests/harness/test_shards.py). The quick lane holds every
# suite, the compiling tests' shared units among them: what a shard plan must keep whole. The full
# lane in two shards would cost a second full lane run, for the same plan and merge code.
QUICK_LANE = RunSpec("cpu-lane-quick", quick=True, suites=tuple(s for s in ALL_SUITES if s != "sensitivity"))
QUICK_SHARD_1 = dataclasses.replace(QUICK_LANE, name="cpu-lane-quick-shard-1-of-2", shard="1/2")
QUICK_SHARD_2 = dataclasses.replace(QUICK_LANE, name="cpu-lane-quick-shard-2-of-2", shard="2/2")
SPECS = (
    LANE,
    SUITES_BUT_SENSITIVITY,
    EXAMPLE,
    REFERENCE,
    MINIMAL,
    TP2,
    EXAMPLE_QUICK,
    EXAMPLE_TP2,
    QUICK_LANE,
    QUICK_SHARD_1,
    QUICK_SHARD_2,
)


@dataclasses.dataclass(frozen=True)
class SharedRun:
    """A finished run: its directory, what `parity run` printed, its exit code."""

    spec: RunSpec
    run_dir: Path
    stdout: str
    returncode: int

    @property
    def rows(self) -> pd.DataFrame:
        from parity.report import read_results

        return read_results(self.run_dir)


def tree_key() -> str:
    """The tracked files' contents, the torch version and the kernel-set variables, hashed."""
    import torch

    digest = hashlib.sha256()
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=PROJECT_ROOT, capture_output=True, check=True).stdout
    for name in sorted(filter(None, listed.split(b"\0"))):
        path = PROJECT_ROOT / os.fsdecode(name)
        digest.update(name + b"\0")
        if path.is_file():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    digest.update(torch.__version__.encode())
    for name in KERNEL_ENV:
        digest.update(f"{name}={os.environ.get(name, '')}".encode())
    return digest.hexdigest()[:16]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class SharedRuns:
    """The session's runs, in `root` (a directory every xdist worker of the session sees)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.key = tree_key()
        self._threads: list[threading.Thread] = []

    def _dir(self, spec: RunSpec) -> Path:
        return self.root / f"{spec.name}-{self.key}"

    def _state(self, spec: RunSpec) -> str:
        base = self._dir(spec)
        if (base / "exit-code").exists():
            return "done"
        return "started" if (base / "started").exists() else "absent"

    def start(self, spec: RunSpec) -> None:
        """Start `spec` in the background unless this session already started it."""
        self.root.mkdir(parents=True, exist_ok=True)
        with _locked(self.root / "runs.lock"):
            if self._state(spec) != "absent":
                return
            base = self._dir(spec)
            base.mkdir(parents=True, exist_ok=True)
            (base / "started").write_text(str(os.getpid()))
            log = open(base / "parity-run.log", "w")  # noqa: SIM115 - closed by the waiting thread
            command = [sys.executable, "-m", "parity", "run", "--report-dir", str(base / "reports"), "--run-id", "run"]
            (base / "tmp").mkdir(exist_ok=True)
            process = subprocess.Popen(
                [*command, *spec.args()],
                cwd=PROJECT_ROOT,
                env=subprocess_env(PYTEST_DEBUG_TEMPROOT=str(base / "tmp")),  # its sessions' temporary files, watched too
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=default_signals,
            )

        def finish() -> None:
            try:
                code = wait_watched(process, [base], poll_s=WATCH_POLL_S)
            except Stalled as stalled:
                code = process.returncode
                log.write(f"\nshared run stopped: {stalled}\n")
            log.close()
            (base / "exit-code").write_text(str(code))

        thread = threading.Thread(target=finish, name=f"shared-run-{spec.name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def get(self, spec: RunSpec) -> SharedRun:
        """The run of `spec`, or of a spec this session runs that covers it; waits for it to end."""
        chosen = next((other for other in SPECS if other.covers(spec) and self._state(other) != "absent"), None)
        if chosen is None:
            self.start(spec)
            chosen = spec
        base = self._dir(chosen)
        while not (base / "exit-code").exists():  # the starting process writes it, also for a run stopped as stalled
            if not _alive(int((base / "started").read_text() or 0)) and not (base / "exit-code").exists():
                raise RuntimeError(f"the process that started the shared run {chosen.name} ended without its exit code ({base})")
            time.sleep(0.5)
        stdout = (base / "parity-run.log").read_text(errors="replace")
        code = int((base / "exit-code").read_text())
        return SharedRun(chosen, base / "reports" / "run", stdout, code)

    def join(self) -> None:
        """Wait for the runs this process started (a run never outlives the session that made it)."""
        for thread in self._threads:
            thread.join()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def shared_root(basetemp: Path) -> Path:
    """The session's directory every xdist worker sees: workers' basetemps are `popen-gwN/` inside
    the session's directory; serially the basetemp is the session's directory itself."""
    return (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "shared-runs"


def copy_run(run_dir: Path, dest: Path) -> Path:
    shutil.copytree(run_dir, dest)
    return dest


def writer_for(run_dir: Path) -> ReportWriter:
    """A writer with the context (run id, target, device, ...) of the run's existing rows."""
    from parity.report import read_results

    first = read_results(run_dir).iloc[0]
    return ReportWriter(run_dir, {column: first[column] for column in CONTEXT_COLUMNS})


def write_rows(run_dir: Path, frame: pd.DataFrame) -> Path:
    """Replace a run directory's results.csv with `frame` (same columns)."""
    frame.to_csv(run_dir / RESULTS_FILE, index=False)
    return run_dir

"""The run a pytest session belongs to: its options, read once, its target, its report writer and
the status its `run.json` records.

`RunSession.from_config` reads every `--parity-*` option once and refuses contradictions with a
`pytest.UsageError`: an unsafe run id, a run directory that already holds a run (unless
`--parity-overwrite` or `--parity-append`). The run directory is created at the first report row
(by whichever process writes it, under the writer's file lock), together with `run.json` saying
`status: running`: a pytest session of the environment that never writes a row (the plugin is
installed for every session) leaves nothing. The process that runs the session (the xdist
controller, or the only process) records the end: `complete`, `interrupted` (with the signal or
pytest's reason) or `crashed` (`finish_run`). Under pytest-xdist the controller chooses the run id
and hands it to the workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from parity import env
from parity.plugin import ranks, shards
from parity.plugin.options import DEFAULT_DTYPE, PYTEST_PREFIX, check_run_id, check_seed
from parity.plugin.resume import ResumePlan, same_selection
from parity.report import (
    COMPLETE,
    CRASHED,
    INTERRUPTED,
    RESULTS_FILE,
    RUN_INFO_FILE,
    RUNNING,
    ReportWriter,
    new_run_id,
    now_text,
    read_run_info,
    update_run_info,
    write_run_info,
)
from parity.report.quick import quick_size
from parity.report.rundir import (
    OWNER_FILE,
    RunClaim,
    RunInUse,
    UnsafePathError,
    owner_alive,
    process_alive,
    read_owner,
)
from parity.report.schema import INCOMPLETE
from parity.target import PLANTED_SUITE, Target, TargetError, factory_path, resolve_target

DEFAULT_REPORT_DIR = Path("reports") / "runs"  # relative to the directory pytest was started in
WORKER_RUN_DIR = "parity_run_dir"  # key of the run directory in an xdist worker's workerinput
WORKER_CONTROLLER_PID = "parity_controller_pid"  # key of the controller's pid in workerinput
TARGET = pytest.StashKey[Any]()
TARGET_ERROR = pytest.StashKey[TargetError]()
TARGET_INTERRUPTED = pytest.StashKey[bool]()  # the factory was interrupted: the session is ending
# The run.json keys that must agree for `--parity-append` to add rows to an existing run: the
# options, then the torch and the tree that made it (compared where run.json records them), then
# where the target's code came from (`env.target_provenance`; known once the session starts).
APPEND_KEYS = ("device", "size", "dtype", "target", "seed")
APPEND_ENV_KEYS = ("torch", "git_sha")
APPEND_PROVENANCE_KEYS = ("file", "distribution", "version", "git_sha")


def append_mismatch(info: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """How this session (`mine`: the `APPEND_KEYS` and `APPEND_ENV_KEYS` it would record, and
    optionally `target_provenance`) differs from the run it would add rows to (`info`, its
    run.json): one `key: run has ..., this session ...` each. Rows of another torch, tree or target
    code are not the same run: the review would refuse the whole of it (docs/reports.md §1)."""
    differ = [
        f"{key}: run has {info.get(key)!r}, this session {mine[key]!r}" for key in APPEND_KEYS if info.get(key) != mine[key]
    ]
    differ += [
        f"{key}: run has {info[key]!r}, this session {mine[key]!r}"
        for key in APPEND_ENV_KEYS
        if key in mine and info.get(key) not in (None, "") and info[key] != mine[key]
    ]
    theirs, ours = info.get("target_provenance"), mine.get("target_provenance")
    if isinstance(theirs, dict) and isinstance(ours, dict):
        differ += [
            f"target {key}: run has {theirs[key]!r}, this session {ours.get(key)!r}"
            for key in APPEND_PROVENANCE_KEYS
            if theirs.get(key) not in (None, "") and theirs[key] != ours.get(key)
        ]
    return differ


def option(config: pytest.Config, name: str) -> Any:
    """The value of `--parity-<name>`."""
    return config.getoption(f"{PYTEST_PREFIX}{name}".replace("-", "_"))


def session_target(config: pytest.Config) -> Target:
    """The target of this session, resolved once (`parity.target.resolve_target`); a failure is
    remembered and raised again as the same one-line `TargetError`."""
    if TARGET in config.stash:
        return config.stash[TARGET]
    if TARGET_ERROR in config.stash:
        raise config.stash[TARGET_ERROR]
    group = config.stash.get(ranks.GROUP, None)
    try:
        tp = group.tensor_parallel() if group is not None else None
        if group is not None:
            group.moved(f"calling the target's factory ({option(config, 'target')})")
        config.stash[TARGET] = resolve_target(option(config, "target"), option=f"--{PYTEST_PREFIX}target", tp=tp)
        if group is not None:
            group.moved("the target's factory returned")
    except TargetError as exc:
        config.stash[TARGET_ERROR] = exc
        raise
    except BaseException:  # interrupted (Ctrl-C, a broken tensor-parallel group): never called twice
        config.stash[TARGET_INTERRUPTED] = True
        raise
    return config.stash[TARGET]


def _describe_existing(run_dir: Path) -> str:
    info = read_run_info(run_dir)
    status = info.get("status", "no status recorded")
    results = run_dir / RESULTS_FILE
    rows = max(0, sum(1 for _ in results.open("rb")) - 1) if results.is_file() else 0
    return f"status {status}, {rows} row(s)"


def _is_run_dir(path: Path) -> bool:
    return (path / RESULTS_FILE).is_file() or (path / RUN_INFO_FILE).is_file()


@dataclasses.dataclass(frozen=True)
class RunSession:
    """The options of this run, resolved once, as one object a suite can pass around."""

    device: str
    size: str
    dtype: str
    target: str
    run_dir: Path
    seed: int = 0
    suites: tuple[str, ...] = ()
    cases_dirs: tuple[Path, ...] = ()
    append: bool = False
    controller_pid: int = 0
    checkpoint_layout: str = "parity"
    tp: int = 1  # tensor-parallel ranks (parity.plugin.ranks)
    mutants: bool = False  # --parity-mutants (or --parity-suite target_mutants): the planted catalogue runs
    quick: bool = False  # --parity-quick: the quick lane (parity.plugin.quick); rows say `<size>-quick`

    @property
    def report_size(self) -> str:
        """The `size` of this run's rows and run.json: a quick run's say so (docs/cli.md §11)."""
        return quick_size(self.size) if self.quick else self.size

    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @classmethod
    def from_config(cls, config: pytest.Config, run_dir: Path | None = None) -> RunSession:
        """The session's options. `run_dir`: a tensor-parallel peer's own directory inside rank 0's
        run (`parity.plugin.ranks`), emptied of an earlier run's rows; claimed by rank 0's run."""
        device = option(config, "device")
        dtype = option(config, "dtype") or DEFAULT_DTYPE[device]
        worker_input = getattr(config, "workerinput", None)
        append = bool(option(config, "append"))
        peer = run_dir is not None
        if worker_input is not None:
            run_dir = Path(worker_input[WORKER_RUN_DIR])
            controller = int(worker_input.get(WORKER_CONTROLLER_PID, 0))
        elif run_dir is not None:
            controller = os.getpid()
            try:
                _empty_peer_dir(run_dir)
            except RunDirError as exc:
                raise pytest.UsageError(str(exc)) from None
        else:
            controller = os.getpid()
            run_id = option(config, "run_id")
            try:
                if run_id is not None:
                    check_run_id(run_id, f"--{PYTEST_PREFIX}run-id")
                check_seed(option(config, "seed"), f"--{PYTEST_PREFIX}seed")
            except ValueError as exc:
                raise pytest.UsageError(str(exc)) from None
            base = Path(option(config, "report_dir") or Path(config.invocation_params.dir) / DEFAULT_REPORT_DIR)
            run_dir = base / (run_id or new_run_id())
            try:
                claim_run_dir(run_dir, overwrite=bool(option(config, "overwrite")), append=append)
            except RunDirError as exc:
                raise pytest.UsageError(str(exc)) from None
        cases = tuple(Path(d) for d in option(config, "cases"))
        for directory in cases:
            if not directory.is_dir():
                raise pytest.UsageError(f"--parity-cases {directory}: not a directory")
        session = cls(
            device=device,
            size=option(config, "size"),
            dtype=dtype,
            target=option(config, "target"),
            run_dir=run_dir.absolute(),
            seed=option(config, "seed"),
            suites=tuple(option(config, "suite")),
            cases_dirs=tuple(d.absolute() for d in cases),
            append=append,
            controller_pid=controller,
            checkpoint_layout=option(config, "checkpoint_layout"),
            tp=option(config, "tp"),
            mutants=bool(option(config, "mutants")) or PLANTED_SUITE in option(config, "suite"),
            quick=bool(option(config, "quick")),
        )
        if worker_input is None and not peer and append and _is_run_dir(session.run_dir):
            session.check_append()
        if worker_input is None and not peer and option(config, "run_id") is not None:
            try:  # a run id given by name is claimed now; a fresh random one cannot be named by another run
                take_run_dir(config, session.run_dir, overwrite=bool(option(config, "overwrite")), append=append)
            except RunDirError as exc:
                raise pytest.UsageError(str(exc)) from None
        return session

    def check_append(self) -> None:
        """`--parity-append` adds rows to a run of the same configuration, torch, tree and target
        code only (`append_mismatch`)."""
        info = read_run_info(self.run_dir)
        mine: dict[str, Any] = {"device": self.device, "size": self.report_size, "dtype": self.dtype, "target": self.target}
        mine.update(seed=self.seed, torch=env.torch_version(), git_sha=env.git_sha())
        with contextlib.suppress(TargetError):  # an unknown spec: the run stops on it elsewhere
            mine["target_provenance"] = env.target_provenance(self.target, factory_path(self.target))
        differ = append_mismatch(info, mine)
        if differ:
            raise pytest.UsageError(
                f"--parity-append {self.run_dir}: the existing run was made with another configuration ({'; '.join(differ)})"
            )

    def run_info(self, config: pytest.Config) -> dict[str, Any]:
        """What `run.json` says about the run: its options, the environment, and `status: running`
        with the controlling process (so a review can tell a live run from one that died)."""
        info = {"run_id": self.run_dir.name, "args": list(config.invocation_params.args), **env.describe(self.device)}
        info.update(size=self.report_size, dtype=self.dtype, target=self.target, seed=self.seed)
        info["checkpoint_layout"] = self.checkpoint_layout
        info["tp"] = self.tp
        if self.quick:
            info["quick"] = True  # rows say `<size>-quick` (parity.report.quick)
        try:
            info["target_provenance"] = env.target_provenance(self.target, factory_path(self.target))
            if TARGET in config.stash:  # resolved before the first row: its name keys its baselines (docs/reports.md)
                info["target_provenance"]["name"] = str(config.stash[TARGET].name)
        except TargetError as exc:  # an unknown spec: the run stops on it elsewhere; say what was asked
            info["target_provenance"] = {"spec": self.target, "error": str(exc)}
        if self.cases_dirs:
            info["cases_dirs"] = [str(d) for d in self.cases_dirs]
        plan = config.stash.get(shards.SHARD, None)
        if plan is not None:
            info["shard"] = plan.record()
        info.update(status=RUNNING, started=now_text(), pid=self.controller_pid or os.getpid(), host=socket.gethostname())
        return info

    def writer(self, config: pytest.Config) -> ReportWriter:
        """The row writer of this process; the first row written by any process creates the run
        directory and its `run.json`."""
        context = {
            "run_id": self.run_dir.name,
            "target": self.target,
            "device": self.device,
            "dtype": self.dtype,
            "size": self.report_size,
            "tp": str(self.tp),
            "torch_version": env.torch_version(),
            "git_sha": env.git_sha(),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        }
        return ReportWriter(self.run_dir, context, on_create=lambda run_dir: write_run_info(run_dir, self.run_info(config)))

    def resume(self, config: pytest.Config, plan: ResumePlan | None = None) -> dict[str, Any] | None:
        """`--parity-append` to an existing run: its status goes back to running; the outcome of the
        earlier session(s) is kept in `previous_sessions` (a review counts every one), with what
        `plan` (`parity.plugin.resume`) reruns. The tests that hold their rows are deselected by the
        plugin and the rows of half-written ones dropped before the first test. Returns the run.json
        as it was, so a session refused before any test can put it back (`restore`)."""
        if not self.append or not (self.run_dir / RUN_INFO_FILE).is_file():
            return None
        info = read_run_info(self.run_dir)
        keys = ("status", "started", "ended", "signal", "reason", "args", "unwritten_rows")
        earlier = {k: info.get(k) for k in keys if k in info}
        if plan is not None and plan.rerun:
            earlier["rerun_by_next_session"] = sorted(plan.rerun)
        if info.get("status") != COMPLETE and same_selection(info.get("args"), list(config.invocation_params.args)):
            earlier["resumed"] = True  # this session selects the same tests: the review counts it in its place
        update_run_info(
            self.run_dir,
            previous_sessions=[*info.get("previous_sessions", []), earlier],
            status=RUNNING,
            started=now_text(),
            ended=None,
            signal=None,
            reason=None,
            unwritten_rows=None,
            unwritten_tests=None,
            pid=os.getpid(),
            host=socket.gethostname(),
            args=list(config.invocation_params.args),
        )
        return info

    def restore(self, info: dict[str, Any]) -> None:
        """Put back the run.json `resume` found (an appended session refused before any test)."""
        write_run_info(self.run_dir, info)


class RunDirError(ValueError):
    """A run directory that cannot be used as asked; one line naming the option."""


def _empty_peer_dir(run_dir: Path) -> None:
    """A tensor-parallel peer's directory (`<run_dir>/ranks/rank-<r>`) holds this session's rows
    only: an earlier run's there (the same run id on this machine) is removed; anything that is
    not a parity run, or a link, is refused."""
    if run_dir.is_symlink():
        raise RunDirError(f"{run_dir} is a symbolic link: a rank's rows are never written through a link")
    if not run_dir.exists():
        return
    if not run_dir.is_dir() or (any(run_dir.iterdir()) and not _is_run_dir(run_dir)):
        raise RunDirError(f"{run_dir} exists and is not a rank's earlier run: a rank's rows go there; move it away")
    shutil.rmtree(run_dir)


def probe_report_dir(report_dir: Path, option: str) -> None:
    """Create the report directory if needed and write a probe file in it: a directory that cannot
    be written is one line before the run, never an INTERNALERROR at the first row."""
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=report_dir, prefix=".parity-probe-"):
            pass
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise RunDirError(f"{option} {report_dir}: cannot write run directories there ({why})") from None


def claim_run_dir(run_dir: Path, *, overwrite: bool, append: bool, prefix: str = PYTEST_PREFIX) -> None:
    """Refuse, before anything is written, to mix two runs in one directory: a run directory that
    is a symbolic link; one a live run owns (never overwritten, appended to or
    shared: docs/reports.md §2); an existing run without `overwrite` (replace it) or `append` (add to it); a directory that
    is not a parity run. Checks only: the session takes the claim (`take_run_dir`). `prefix`: how
    the options are spelt in the message (`parity-` for pytest, '' for `parity run`)."""
    run_id = f"--{prefix}run-id {run_dir.name!r}"
    if overwrite and append:
        raise RunDirError(f"--{prefix}overwrite and --{prefix}append contradict each other: give one")
    if run_dir.is_symlink():
        raise RunDirError(
            f"{run_id}: {run_dir} is a symbolic link (to {os.readlink(run_dir)}); a run is never written through a link: "
            "choose another run id or report directory"
        )
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise RunDirError(f"{run_id}: {run_dir} exists and is not a directory")
    try:
        live = live_owner(run_dir)
    except UnsafePathError as exc:
        raise RunDirError(f"{run_id}: {exc}") from None
    if live:
        raise RunDirError(_in_use(run_id, run_dir, live, overwrite=overwrite, append=append, prefix=prefix))
    problem = _existing_problem(run_dir, overwrite=overwrite, append=append, prefix=prefix)
    if problem:
        raise RunDirError(problem)


def _existing_problem(run_dir: Path, *, overwrite: bool, append: bool, prefix: str) -> str:
    """Why this session may not use the existing `run_dir` as asked ('' when it may)."""
    run_id = f"--{prefix}run-id {run_dir.name!r}"
    if not run_dir.exists():
        return ""
    if not _is_run_dir(run_dir):
        # the claim file, and the output of a tensor-parallel run's peer ranks, which parity's
        # launcher starts writing before rank 0 writes the first row (parity.plugin.launch)
        if any(p.name not in (OWNER_FILE, ranks.RANKS_DIR) for p in run_dir.iterdir()):
            return (
                f"{run_id}: {run_dir} exists, is not empty and holds no parity run (no {RESULTS_FILE}, no {RUN_INFO_FILE}): "
                "choose another run id or report directory"
            )
        return ""
    if append or overwrite:
        return ""
    return (
        f"{run_id}: {run_dir} already holds a run ({_describe_existing(run_dir)}); "
        f"pass --{prefix}overwrite to replace it or --{prefix}append to add this session's rows to it"
    )


def _in_use(run_id: str, run_dir: Path, owner: str, *, overwrite: bool, append: bool, prefix: str) -> str:
    if overwrite:
        why = f"--{prefix}overwrite would delete the rows it is writing"
    elif append:
        why = "a second session cannot add rows to it while it runs"
    else:
        why = "two runs never share a directory"
    return f"{run_id}: {run_dir} is in use by a live run ({owner}); {why}: wait for it to end or choose another run id"


def live_owner(run_dir: Path) -> str | None:
    """Who is running in `run_dir` now (a process that holds its claim, or, for a run without a
    claim file, a live process run.json names as running), or None when no live process is."""
    alive = owner_alive(run_dir)
    if alive:
        owner = read_owner(run_dir)
        return owner.describe() if owner is not None else "owner record unreadable"
    if alive is None:
        return _running_by_run_info(run_dir)
    return None


def _running_by_run_info(run_dir: Path) -> str | None:
    """A run without a claim (a session without a run id, or an older parity): run.json's
    `running` with a live process of this host other than this one."""
    try:
        info = read_run_info(run_dir)
    except ValueError:
        return None
    pid, host = info.get("pid"), info.get("host")
    if info.get("status") == RUNNING and pid != os.getpid() and process_alive(pid, host):
        return f"process {pid} on {host}, started {info.get('started')}"
    return None


def take_run_dir(config: pytest.Config, run_dir: Path, *, overwrite: bool, append: bool, prefix: str = PYTEST_PREFIX) -> RunClaim:
    """Claim `run_dir` for this session when it starts (docs/reports.md §2): its owner (pid, host,
    time) is recorded in `.parity-owner`, whose lock this process holds until the session ends.
    A second session into the same run id, an `--overwrite` or an `--append` while it runs is
    refused; an owner that has gone (its lock released: the process ended, `kill -9` included) is
    recognised, and its run may be overwritten or appended to. `overwrite` removes the old run
    here, under the claim. The claim is given up when pytest unconfigures; a session that wrote
    no row leaves nothing behind."""
    run_id = f"--{prefix}run-id {run_dir.name!r}"
    try:
        claim = RunClaim.take(run_dir)
    except RunInUse as exc:
        owner = exc.owner.describe() if exc.owner is not None else "owner record unreadable"
        raise RunDirError(_in_use(run_id, run_dir, owner, overwrite=overwrite, append=append, prefix=prefix)) from None
    except (UnsafePathError, OSError) as exc:
        raise RunDirError(f"{run_id}: {exc}") from None
    try:
        live = _running_by_run_info(run_dir) if claim.previous is None else None
        problem = (
            _in_use(run_id, run_dir, live, overwrite=overwrite, append=append, prefix=prefix)
            if live
            else _existing_problem(run_dir, overwrite=overwrite, append=append, prefix=prefix)
        )
        if problem:
            raise RunDirError(problem)
        if overwrite and _is_run_dir(run_dir):
            _clear(run_dir)
        claim.record()
    except BaseException:
        claim.release(keep_record=claim.previous is not None)
        raise
    config.add_cleanup(lambda: claim.release(keep_record=(run_dir / RESULTS_FILE).exists()))
    return claim


def _clear(run_dir: Path) -> None:
    """Remove an ended run's files for `--overwrite`, keeping the claim file this session holds;
    links are removed, never followed."""
    for entry in run_dir.iterdir():
        if entry.name == OWNER_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


# ---------------------------------------------------------------------------------------------
# The end of a run: complete, interrupted (with the signal) or crashed
# ---------------------------------------------------------------------------------------------

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_INTERNAL, EXIT_USAGE, EXIT_NO_TESTS = 0, 1, 2, 3, 4, 5


class SignalWatch:
    """One clean stop for SIGINT, SIGTERM and SIGHUP (a closed terminal): the first of them raises
    KeyboardInterrupt in the main thread, as Python's default SIGINT handler does, so pytest unwinds
    and the run's end is recorded with the signal's name; a repeat while the run stops (a second
    Ctrl-C) is said in one line and otherwise ignored, so recording the end and printing the summary
    are not cut short by a KeyboardInterrupt inside them (they take a moment; `kill -9` still ends
    the process at once). Installed only over the default handlers, in the process that records the
    run's end, and put back afterwards. `parity run` installs one for its whole command; the plugin
    then uses that one (`SignalWatch.active`) instead of installing its own."""

    SIGNALS: ClassVar[tuple[str, ...]] = ("SIGINT", "SIGTERM", "SIGHUP")
    _active: ClassVar[SignalWatch | None] = None

    def __init__(self, who: str = "parity") -> None:
        self.who = who  # how the one line about a repeated signal starts
        self.received: str | None = None
        self.repeats = 0
        self._previous: dict[int, Any] = {}

    @classmethod
    def active(cls) -> SignalWatch | None:
        """The watch installed in this process, if any."""
        return cls._active

    def install(self) -> SignalWatch:
        """Take over each signal of `SIGNALS` whose handler is still the default one; returns self."""
        defaults = {"SIGINT": signal.default_int_handler}
        for name in self.SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:  # not on this platform (SIGHUP on Windows)
                continue
            try:
                if signal.getsignal(signum) is defaults.get(name, signal.SIG_DFL):
                    self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                break
        if self._previous:
            SignalWatch._active = self
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            raise KeyboardInterrupt(f"{name} received")
        self.repeats += 1
        if self.repeats == 1:  # said once; os.write: a print here could re-enter a print it interrupted
            with contextlib.suppress(OSError):
                os.write(
                    2, f"\n{self.who}: {name} again: already stopping after {self.received} (recording the run's end)\n".encode()
                )

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(signum, handler)
        self._previous.clear()
        if SignalWatch._active is self:
            SignalWatch._active = None


def unwritten_text(count: int, error: str) -> str:
    """The reason `run.json` and `parity run` give for rows the disk refused."""
    return f"{count} report row(s) could not be written ({error or 'no error recorded'})" if count else ""


def run_status(exitstatus: int, *, signal_name: str | None, stopped: str, unwritten: str = "") -> dict[str, Any]:
    """The status `run.json` records for a session that ended with pytest's `exitstatus`:
    `complete` (every selected test ran and every row is on disk, whatever the verdicts),
    `interrupted` (a signal, or pytest stopped early: -x, --maxfail, collection errors),
    `incomplete` (every test ran but `unwritten` says rows could not be written: a full disk) or
    `crashed` (an internal error). `unwritten` is added to the reason of any status."""

    def reason(text: str | None) -> str | None:
        return "; ".join(filter(None, [text, unwritten])) or None

    code = int(exitstatus)
    if code == EXIT_INTERRUPTED or signal_name:
        return {
            "status": INTERRUPTED,
            "signal": signal_name,
            "reason": reason(stopped or ("pytest was interrupted" if not signal_name else None)),
        }
    if code in (EXIT_OK, EXIT_FAILED, EXIT_NO_TESTS):
        if stopped:
            return {"status": INTERRUPTED, "signal": None, "reason": reason(f"stopped early: {stopped}")}
        if unwritten:
            return {"status": INCOMPLETE, "signal": None, "reason": unwritten}
        return {"status": COMPLETE, "signal": None, "reason": None}
    if code == EXIT_INTERNAL:
        return {"status": CRASHED, "signal": None, "reason": reason("pytest internal error")}
    return {"status": CRASHED, "signal": None, "reason": reason(f"pytest exit status {code}")}


def finish_run(
    run_dir: Path,
    exitstatus: int,
    *,
    signal_name: str | None,
    stopped: str,
    unwritten: int = 0,
    write_error: str = "",
    unwritten_tests: Iterable[str] = (),
) -> dict[str, Any] | None:
    """Record the end of the run in `run.json` (only where the run directory was created: a session
    without rows has none). Rows the disk refused make it `incomplete` (or are added to the reason
    of an interruption) and are counted in `unwritten_rows`; their tests in `unwritten_tests`, which
    an appended session runs again (`parity.plugin.resume`). Returns what was recorded."""
    if not (run_dir / RUN_INFO_FILE).is_file():
        return None
    status = {
        **run_status(exitstatus, signal_name=signal_name, stopped=stopped, unwritten=unwritten_text(unwritten, write_error)),
        "ended": now_text(),
        "exitstatus": int(exitstatus),
        "unwritten_rows": int(unwritten) or None,
        "unwritten_tests": sorted(set(unwritten_tests)) or None,
    }
    update_run_info(run_dir, **status)
    return status

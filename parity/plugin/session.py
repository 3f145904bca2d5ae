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
from pathlib import Path
from typing import Any

import pytest

from parity import env
from parity.plugin.options import DEFAULT_DTYPE, PYTEST_PREFIX, check_run_id, check_seed
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
from parity.target import TargetError, factory_path, resolve_target

DEFAULT_REPORT_DIR = Path("reports") / "runs"  # relative to the directory pytest was started in
WORKER_RUN_DIR = "parity_run_dir"  # key of the run directory in an xdist worker's workerinput
WORKER_CONTROLLER_PID = "parity_controller_pid"  # key of the controller's pid in workerinput
TARGET = pytest.StashKey[Any]()
TARGET_ERROR = pytest.StashKey[TargetError]()
# The run.json keys that must agree for `--parity-append` to add rows to an existing run.
APPEND_KEYS = ("device", "size", "dtype", "target", "seed")


def option(config: pytest.Config, name: str) -> Any:
    """The value of `--parity-<name>`."""
    return config.getoption(f"{PYTEST_PREFIX}{name}".replace("-", "_"))


def session_target(config: pytest.Config) -> Any:
    """The target of this session, resolved once (`parity.target.resolve_target`); a failure is
    remembered and raised again as the same one-line `TargetError`."""
    if TARGET in config.stash:
        return config.stash[TARGET]
    if TARGET_ERROR in config.stash:
        raise config.stash[TARGET_ERROR]
    try:
        config.stash[TARGET] = resolve_target(option(config, "target"), option=f"--{PYTEST_PREFIX}target")
    except TargetError as exc:
        config.stash[TARGET_ERROR] = exc
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

    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @classmethod
    def from_config(cls, config: pytest.Config) -> RunSession:
        device = option(config, "device")
        dtype = option(config, "dtype") or DEFAULT_DTYPE[device]
        worker_input = getattr(config, "workerinput", None)
        append = bool(option(config, "append"))
        if worker_input is not None:
            run_dir = Path(worker_input[WORKER_RUN_DIR])
            controller = int(worker_input.get(WORKER_CONTROLLER_PID, 0))
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
        )
        if worker_input is None and append and _is_run_dir(session.run_dir):
            session.check_append()
        return session

    def check_append(self) -> None:
        """`--parity-append` adds rows to a run of the same configuration only."""
        info = read_run_info(self.run_dir)
        mine = {"device": self.device, "size": self.size, "dtype": self.dtype, "target": self.target, "seed": self.seed}
        differ = [
            f"{key}: run has {info.get(key)!r}, this session {mine[key]!r}" for key in APPEND_KEYS if info.get(key) != mine[key]
        ]
        if differ:
            raise pytest.UsageError(
                f"--parity-append {self.run_dir}: the existing run was made with another configuration ({'; '.join(differ)})"
            )

    def run_info(self, config: pytest.Config) -> dict[str, Any]:
        """What `run.json` says about the run: its options, the environment, and `status: running`
        with the controlling process (so a review can tell a live run from one that died)."""
        info = {"run_id": self.run_dir.name, "args": list(config.invocation_params.args), **env.describe(self.device)}
        info.update(size=self.size, dtype=self.dtype, target=self.target, seed=self.seed)
        info["checkpoint_layout"] = self.checkpoint_layout
        try:
            info["target_provenance"] = env.target_provenance(self.target, factory_path(self.target))
        except TargetError as exc:  # an unknown spec: the run stops on it elsewhere; say what was asked
            info["target_provenance"] = {"spec": self.target, "error": str(exc)}
        if self.cases_dirs:
            info["cases_dirs"] = [str(d) for d in self.cases_dirs]
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
            "size": self.size,
            "torch_version": env.torch_version(),
            "git_sha": env.git_sha(),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        }
        return ReportWriter(self.run_dir, context, on_create=lambda run_dir: write_run_info(run_dir, self.run_info(config)))

    def resume(self, config: pytest.Config) -> dict[str, Any] | None:
        """`--parity-append` to an existing run: its status goes back to running; the outcome of the
        earlier session(s) is kept in `previous_sessions` (a review counts every one). Returns the
        run.json as it was, so a session refused before any test can put it back (`restore`)."""
        if not self.append or not (self.run_dir / RUN_INFO_FILE).is_file():
            return None
        info = read_run_info(self.run_dir)
        earlier = {k: info.get(k) for k in ("status", "started", "ended", "signal", "reason", "args") if k in info}
        update_run_info(
            self.run_dir,
            previous_sessions=[*info.get("previous_sessions", []), earlier],
            status=RUNNING,
            started=now_text(),
            ended=None,
            signal=None,
            reason=None,
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
    """Refuse to mix two runs in one directory: an existing run is replaced only with `overwrite`
    (removed here) and added to only with `append`; a directory that is not a parity run is never
    removed. `prefix`: how the options are spelt in the message (`parity-` for pytest, '' for `parity run`)."""
    run_id = f"--{prefix}run-id {run_dir.name!r}"
    if overwrite and append:
        raise RunDirError(f"--{prefix}overwrite and --{prefix}append contradict each other: give one")
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise RunDirError(f"{run_id}: {run_dir} exists and is not a directory")
    if not _is_run_dir(run_dir):
        if any(run_dir.iterdir()):
            raise RunDirError(
                f"{run_id}: {run_dir} exists, is not empty and holds no parity run (no {RESULTS_FILE}, no {RUN_INFO_FILE}): "
                "choose another run id or report directory"
            )
        return
    if append:
        return
    if overwrite:
        shutil.rmtree(run_dir)
        return
    raise RunDirError(
        f"{run_id}: {run_dir} already holds a run ({_describe_existing(run_dir)}); "
        f"pass --{prefix}overwrite to replace it or --{prefix}append to add this session's rows to it"
    )


# ---------------------------------------------------------------------------------------------
# The end of a run: complete, interrupted (with the signal) or crashed
# ---------------------------------------------------------------------------------------------

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_INTERNAL, EXIT_USAGE, EXIT_NO_TESTS = 0, 1, 2, 3, 4, 5


class SignalWatch:
    """Remembers which signal interrupted the session: SIGINT raises KeyboardInterrupt as Python's
    default handler does, and SIGTERM (which would end the process on the spot) raises it too, so
    pytest unwinds and the run's end is recorded. Installed only in the process that records the
    run's end, only over the default handlers, and put back afterwards."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        for signum, default in defaults.items():
            try:
                if signal.getsignal(signum) is default:
                    self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                return

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name
        raise KeyboardInterrupt(f"{self.received} received")

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(signum, handler)
        self._previous.clear()


def run_status(exitstatus: int, *, signal_name: str | None, stopped: str) -> dict[str, Any]:
    """The status `run.json` records for a session that ended with pytest's `exitstatus`:
    `complete` (every selected test ran, whatever their verdicts), `interrupted` (a signal, or
    pytest stopped early: -x, --maxfail, collection errors) or `crashed` (an internal error)."""
    code = int(exitstatus)
    if code == EXIT_INTERRUPTED or signal_name:
        return {
            "status": INTERRUPTED,
            "signal": signal_name,
            "reason": stopped or ("pytest was interrupted" if not signal_name else None),
        }
    if code in (EXIT_OK, EXIT_FAILED, EXIT_NO_TESTS):
        if stopped:
            return {"status": INTERRUPTED, "signal": None, "reason": f"stopped early: {stopped}"}
        return {"status": COMPLETE, "signal": None, "reason": None}
    if code == EXIT_INTERNAL:
        return {"status": CRASHED, "signal": None, "reason": "pytest internal error"}
    return {"status": CRASHED, "signal": None, "reason": f"pytest exit status {code}"}


def finish_run(run_dir: Path, exitstatus: int, *, signal_name: str | None, stopped: str) -> dict[str, Any] | None:
    """Record the end of the run in `run.json` (only where the run directory was created: a session
    without rows has none). Returns what was recorded."""
    if not (run_dir / RUN_INFO_FILE).is_file():
        return None
    status = {
        **run_status(exitstatus, signal_name=signal_name, stopped=stopped),
        "ended": now_text(),
        "exitstatus": int(exitstatus),
    }
    update_run_info(run_dir, **status)
    return status

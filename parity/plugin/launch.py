"""Starting the ranks of a tensor-parallel session on this machine with torch's own launcher.

`pytest --parity-tp N` (and `parity run --tp N`, which runs pytest) in a process that no launcher
started: instead of running the session itself, the process starts N ranks of the same command
line through `torch.distributed.launcher` (what `torchrun --standalone --nproc-per-node N` does:
a c10d rendezvous on a free local port, one agent, no restarts), waits for them and answers
with rank 0's exit status. Rank 0's output is this terminal; rank r > 0 writes to
`RUN_DIR/ranks/rank-<r>.log` (`parity.plugin.rank_output`). The agent stops every rank when one
of them fails; a rank that died is named here in one line (its exit status and its output), and
run.json says so (docs/lanes.md §5). Across machines, use torchrun itself: every rank then
reads its place from torchrun's environment (`parity.plugin.ranks`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from parity.plugin import ranks
from parity.plugin.options import PYTEST_PREFIX

EXIT_INTERRUPTED, EXIT_USAGE, EXIT_NO_TESTS = 2, 4, 5
# The signals torch's agent takes over while it runs (LaunchConfig.signals_to_handle); put back after.
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def needs_launch(config: pytest.Config) -> bool:
    """Whether this pytest process must start the ranks: `--parity-tp` above 1, and no launcher
    started it as a rank."""
    tp = config.getoption(f"{PYTEST_PREFIX}tp".replace("-", "_"), 1) or 1
    asked_for_help = config.getoption("help", False) or config.getoption("version", False)
    return tp > 1 and not asked_for_help and ranks.launched_rank() is None


def _run_dir(config: pytest.Config, args: list[str]) -> tuple[Path, list[str]]:
    """The run directory every rank will use, and the arguments that name it: a session without a
    run id gets one here, so rank 0 and this process mean the same directory."""
    run_id = config.getoption(f"{PYTEST_PREFIX}run_id".replace("-", "_"))
    if run_id is None:
        from parity.report import new_run_id

        run_id = new_run_id()
        args = [*args, f"--{PYTEST_PREFIX}run-id", run_id]
    report_dir = config.getoption(f"{PYTEST_PREFIX}report_dir".replace("-", "_"))
    base = Path(report_dir) if report_dir else Path(config.invocation_params.dir) / "reports" / "runs"
    return (base / run_id).absolute(), args


@contextlib.contextmanager
def _agent_signals() -> Iterator[None]:
    """The agent installs its own handlers for SIGTERM, SIGINT, SIGHUP and SIGQUIT (a signal stops
    every rank with it); this process's own come back afterwards."""
    saved = {}
    for name in AGENT_SIGNALS:
        signum = getattr(signal, name, None)
        if signum is not None:
            saved[signum] = signal.getsignal(signum)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler)


def launch(config: pytest.Config) -> int:
    """Start `--parity-tp N` ranks of this command line on this machine; rank 0's exit status."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world_size = int(config.getoption(f"{PYTEST_PREFIX}tp".replace("-", "_")))
    ranks.check_options(config, world_size)
    run_dir, args = _run_dir(config, list(config.invocation_params.args))
    os.environ.pop(ranks.RANK_PID_ENV, None)  # a rank's child starting its own ranks: they are not its rank
    if config.getoption(f"{PYTEST_PREFIX}device".replace("-", "_")) == "cuda":
        for name, value in ranks.NCCL_ENV.items():
            os.environ.setdefault(name, value)
    agent_dir = Path(tempfile.mkdtemp(prefix="parity-launch-"))  # the agent's error files, removed after
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"parity-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone
        max_restarts=0,
        logs_specs=DefaultLogsSpecs(log_dir=str(agent_dir)),
    )
    # Where every GPU is a rank, the launcher would bind each to its NUMA node with numactl, which a
    # machine need not have; parity's ranks run as started (torchrun users choose with --numa-binding).
    launch_config.numa_options = None
    log = str(run_dir / ranks.RANKS_DIR / "rank-{rank}.log")
    command = ["-m", "parity.plugin.rank_output", log, "--", "-m", "pytest", *args]
    try:
        with _agent_signals():
            elastic_launch(launch_config, sys.executable)(*command)
        code = 0
    except ChildFailedError as exc:
        code = _answer(exc.failures, run_dir)
    except SignalException as exc:
        print(f"parity: the tensor-parallel ranks were stopped by {exc.sigval.name}", file=sys.stderr)
        code = EXIT_INTERRUPTED
    finally:
        shutil.rmtree(agent_dir, ignore_errors=True)
    if code in (EXIT_USAGE, EXIT_NO_TESTS):
        _forget_logs(run_dir)  # refused before any row: no run directory is left behind
    return code


def _answer(failures: dict[int, Any], run_dir: Path) -> int:
    """The launch's exit status: rank 0's when it ended by itself with one (it recorded the run and
    said what went wrong), else "interrupted". A peer hands rank 0 its end and exits 0, so a peer
    that failed by itself (a positive status), or any that failed while rank 0 did not, never got
    there: one line each, and the same in run.json. Peers stopped by a signal after rank 0 failed
    are the agent stopping the others, not news."""
    rank0 = failures.get(0)
    lines = [
        f"rank {rank} exited with status {failure.exitcode} (its output: {run_dir / ranks.RANKS_DIR / f'rank-{rank}.log'})"
        for rank, failure in sorted(failures.items())
        if rank != 0 and (failure.exitcode > 0 or rank0 is None)
    ]
    if rank0 is not None and rank0.exitcode < 0:  # killed outright (a crash, SIGKILL): it recorded nothing of it
        lines.insert(0, f"rank 0 was killed by {_signal_name(-rank0.exitcode)} (its output: above)")
    for line in lines:
        print(f"parity: tensor-parallel group broken: {line}", file=sys.stderr)
    if lines:
        _record(run_dir, lines)
    if rank0 is not None and rank0.exitcode > 0:
        return int(rank0.exitcode)
    return EXIT_INTERRUPTED if lines or rank0 is not None else 0


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _record(run_dir: Path, lines: list[str]) -> None:
    """Add the ranks that failed to the reason run.json gives for a run that did not complete."""
    from parity.report import COMPLETE, CRASHED, RUN_INFO_FILE, RUNNING, now_text, read_run_info, update_run_info

    if not (run_dir / RUN_INFO_FILE).is_file():
        return
    info = read_run_info(run_dir)
    if info.get("status") == COMPLETE:
        return
    said = "tensor-parallel group broken: " + "; ".join(lines)
    changes = {"reason": "; ".join(filter(None, [info.get("reason"), said])), "rank_failures": lines}
    if info.get("status") == RUNNING:  # rank 0 died without recording its end: the launcher saw it go
        changes.update(status=CRASHED, ended=now_text())
    update_run_info(run_dir, **changes)


def _forget_logs(run_dir: Path) -> None:
    """The peers' logs of a session refused before its first row, and the run directory they made."""
    from parity.report import RESULTS_FILE, RUN_INFO_FILE

    if (run_dir / RESULTS_FILE).exists() or (run_dir / RUN_INFO_FILE).exists():
        return
    shutil.rmtree(run_dir / ranks.RANKS_DIR, ignore_errors=True)
    with contextlib.suppress(OSError):
        run_dir.rmdir()

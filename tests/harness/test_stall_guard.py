"""The hang guards judge progress, not the clock (`parity.observe.progress`, docs/cli.md §9).

A child that stops (frozen with SIGSTOP, asleep for good) is ended once it has shown no progress for
the stall limit, with everything it started; a child slower than the limit that keeps progressing
(printing, or writing a heartbeat file) runs to its end, however long that takes. The broken
variant, a guard that counts total seconds, ends the slow child: the test that shows it runs on.
`check-target`'s limit is the target's own time: a queue for the CPU is not charged to it.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from parity.observe import progress
from parity.observe.progress import STALL_ENV, Stalled, StallWatch, TargetClock, run_watched, stall_limit, wait_watched

pytestmark = pytest.mark.parity_cpu

LIMIT_S = 3.0  # the stall limit of these children: far above a scheduling gap, so only a real stop trips it

FROZEN = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("helper", helper.pid, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen: no output, no CPU, nothing written
    """
)


def slow(beat: str | None) -> str:
    """A child that runs for twice the limit, printing (or, with `beat`, touching that file
    instead) every 50 ms: slower than the limit, never stalled."""
    step = f"pathlib.Path({beat!r}).touch()" if beat else "print(n, flush=True)"
    return textwrap.dedent(
        f"""
        import pathlib, time
        start, n = time.monotonic(), 0
        while time.monotonic() - start < {2 * LIMIT_S}:
            {step}
            n += 1
            time.sleep(0.05)
        print("done", n, flush=True)
        """
    )


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, killed and waiting for its new parent to reap it, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


def test_a_frozen_child_is_ended_with_what_it_started() -> None:
    with pytest.raises(Stalled) as stalled:
        run_watched([sys.executable, "-c", FROZEN], stall_s=LIMIT_S)
    assert f"made no progress for {LIMIT_S:g} s" in str(stalled.value) and STALL_ENV in str(stalled.value)
    helper = int(stalled.value.output.split()[1])  # the output so far comes with the error
    assert not _alive(helper), "the frozen child's own child was left running"


def test_a_slow_child_that_keeps_printing_runs_to_its_end() -> None:
    done = run_watched([sys.executable, "-c", slow(None)], stall_s=LIMIT_S)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr


def test_a_slow_child_that_writes_a_heartbeat_runs_to_its_end(tmp_path: Path) -> None:
    """Silent on its pipes; its heartbeat file under a watched directory is its progress."""
    done = run_watched([sys.executable, "-c", slow(str(tmp_path / "beat"))], stall_s=LIMIT_S, watch=[tmp_path])
    assert done.returncode == 0 and "done" in done.stdout, done.stderr


@pytest.mark.parametrize("child", ["frozen", "slow"])
def test_a_child_writing_to_a_log_is_judged_by_its_log(child: str, tmp_path: Path) -> None:
    """`wait_watched`, as the test command's shared runs use it: the output goes to a file, and
    that file (under a watched directory) is the progress."""
    import subprocess

    log = tmp_path / "child.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-c", FROZEN if child == "frozen" else slow(None)], stdout=out)
    if child == "frozen":
        with pytest.raises(Stalled):
            wait_watched(process, [tmp_path], stall_s=LIMIT_S)
        assert process.returncode is not None  # ended and reaped
    else:
        assert wait_watched(process, [tmp_path], stall_s=LIMIT_S) == 0 and "done" in log.read_text()


def test_a_guard_on_total_time_would_end_the_slow_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switched-off variant: progress never counted, the guard is a wall-clock budget, and the
    slow child that keeps printing is ended as if it hung."""
    monkeypatch.setattr(StallWatch, "progressed", lambda self: None)
    with pytest.raises(Stalled):
        run_watched([sys.executable, "-c", slow(None)], stall_s=LIMIT_S)


def test_the_limit_is_one_documented_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STALL_ENV, raising=False)
    assert stall_limit() == progress.DEFAULT_STALL_S == 900.0
    monkeypatch.setenv(STALL_ENV, "45")
    assert stall_limit() == 45.0 and stall_limit(2) == 2.0
    for bad in ("soon", "0", "-1", "inf"):
        monkeypatch.setenv(STALL_ENV, bad)
        with pytest.raises(ValueError, match=STALL_ENV):
            stall_limit()


def test_a_watch_counts_idle_time_from_the_last_progress(tmp_path: Path) -> None:
    """On a clock the test moves: output, a new file and a changed file each restart the count."""
    now = [0.0]
    watch = StallWatch(10.0, [tmp_path], clock=lambda: now[0], poll_s=0.0)
    now[0] = 9.0
    assert not watch.stalled()
    watch.progressed()
    now[0] = 18.0
    assert not watch.stalled()
    (tmp_path / "row").write_text("1")
    now[0] = 27.0
    assert not watch.stalled()  # the new file, seen at 27: counted from there
    now[0] = 37.0
    assert watch.stalled()


def test_the_targets_clock_leaves_out_the_queue_for_a_cpu() -> None:
    """Wall time less the time the process queued for a CPU, interval by interval: 10 s of wall
    time of which 6 queued is 4 s of the target's time; a target blocked (no queue) is charged all."""
    now, queued = [0.0], [0.0]
    clock = TargetClock(1, clock=lambda: now[0], queued=lambda pid: queued[0])
    now[0], queued[0] = 10.0, 6.0
    assert clock.read() == pytest.approx(4.0)
    now[0] = 20.0  # asleep or waiting on a lock: no queue
    assert clock.read() == pytest.approx(14.0)
    now[0], queued[0] = 21.0, 9.0  # more queued than elapsed (several threads): nothing, never less
    assert clock.read() == pytest.approx(14.0)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="no /proc: the target's clock is the wall clock there")
def test_the_kernel_gives_the_run_delay_and_cpu_time_it_reads() -> None:
    assert progress.queued_seconds(os.getpid()) is not None and progress.queued_seconds(os.getpid()) >= 0
    assert progress.cpu_seconds(os.getpid()) is not None and progress.cpu_seconds(os.getpid()) > 0

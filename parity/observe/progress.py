"""Hang guards that judge progress, never the clock (docs/cli.md §9).

A child process the harness or its tests start (a `parity run` the tests share, a pytest session
of the mutant catalogue, a repro, a git call) is stopped when it has made no progress for
`PARITY_STALL_S` seconds, not after a fixed total time: a busy machine makes a healthy child slow,
and a guard that counts total seconds turns that slowness into a red verdict. Progress is what a
working child leaves behind: new output on its pipes, or a change (a new file, a size or a
modification time) under the paths it writes: its log, its report rows, a heartbeat file.

`parity check-target`'s own limit is the target's time, not a stall (docs/targets.md §8); the
`TargetClock` here makes it the time the target had a CPU or waited on something other than one,
so that the queue for a CPU on a loaded machine is not charged to the target either.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

STALL_ENV = "PARITY_STALL_S"
# Generous: the longest silent stretch of a healthy child is an Inductor compile or a mutant
# session's first test, minutes on a loaded 2-core machine; a child hung for good is stopped after this.
DEFAULT_STALL_S = 900.0
POLL_S = 0.5  # how often watched paths are looked at


def seconds_setting(given: float | None, env: str, default: float, what: str) -> float:
    """A positive, finite number of seconds: `given`, else $`env`, else `default`; `what` names
    the setting in the error a bad value gets."""
    if given is None:
        text = os.environ.get(env, "").strip()
        if not text:
            return default
        try:
            given = float(text)
        except ValueError:
            raise ValueError(f"{env}={text!r}: expected a number of seconds") from None
    if not given > 0 or given == float("inf"):
        raise ValueError(f"{what} {given!r}: expected a finite number of seconds > 0")
    return float(given)


def stall_limit(given: float | None = None) -> float:
    """Seconds without progress after which a child is stopped: `given`, else $PARITY_STALL_S, else 900."""
    return seconds_setting(given, STALL_ENV, DEFAULT_STALL_S, STALL_ENV)


class Stalled(subprocess.TimeoutExpired):
    """A child stopped because it made no progress for `limit` seconds. A `TimeoutExpired`, so code
    that handled a timed-out child handles this one."""

    def __init__(self, cmd: Any, limit: float, output: Any = None, stderr: Any = None, watched: Sequence[Path] = ()) -> None:
        super().__init__(cmd, limit, output, stderr)
        self.limit = limit
        self.watched = tuple(watched)

    def __str__(self) -> str:
        where = "no new output" + (f", nothing changed under {', '.join(map(str, self.watched))}" if self.watched else "")
        return f"{_command_text(self.cmd)} made no progress for {self.limit:g} s ({where}): stopped ({STALL_ENV} sets the limit)"


def _command_text(cmd: Any) -> str:
    text = " ".join(map(str, cmd)) if isinstance(cmd, (list, tuple)) else str(cmd)
    return text if len(text) <= 160 else text[:157] + "..."


def path_state(paths: Iterable[str | Path]) -> tuple[Any, ...]:
    """What the watched paths hold now: every file under each (a directory is walked) with its size
    and modification time; a missing path is None. Two equal states: nothing was written between."""
    state: list[Any] = []
    for root in map(Path, paths):
        if root.is_dir():
            entries = []
            for directory, _dirs, files in os.walk(root):
                for name in files:
                    with contextlib.suppress(OSError):
                        found = os.stat(os.path.join(directory, name))
                        entries.append((directory, name, found.st_size, found.st_mtime_ns))
            state.append(tuple(sorted(entries)))
        else:
            try:
                found = root.stat()
            except OSError:
                state.append(None)
            else:
                state.append((found.st_size, found.st_mtime_ns))
    return tuple(state)


class StallWatch:
    """The time since the last progress of one child: `progressed()` when it shows some (output),
    `stalled()` looks at the watched paths (at most every `POLL_S`) and says whether the child has
    been idle for `limit` seconds."""

    def __init__(
        self, limit: float, paths: Iterable[str | Path] = (), clock: Callable[[], float] = time.monotonic, poll_s: float = POLL_S
    ) -> None:
        self.limit = limit
        self.paths = tuple(Path(p) for p in paths)
        self.clock = clock
        self.poll_s = poll_s
        self.last = clock()
        self._looked = self.last
        self._state = path_state(self.paths) if self.paths else ()

    def progressed(self) -> None:
        self.last = self.clock()

    def stalled(self) -> bool:
        now = self.clock()
        if self.paths and now - self._looked >= self.poll_s:
            self._looked = now
            state = path_state(self.paths)
            if state != self._state:
                self._state = state
                self.last = now
        return now - self.last >= self.limit


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children first, then theirs), from /proc; [] where there is none."""
    parents: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        children = parents.get(queue.pop(0), [])
        found += children
        queue += children
    return found


# How long `kill_tree` waits for a killed process to be gone. SIGKILL cannot be caught, but its
# delivery and the exit that follows take scheduling time, seconds on a loaded machine; only a
# process stuck in an uninterruptible wait (a dead network mount) outlasts this.
KILL_WAIT_S = 60.0


def running(pid: int) -> bool:
    """Whether `pid` still runs: not gone, and not a zombie (ended, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        if os.path.isdir("/proc"):
            return False  # no entry: gone
        try:  # no /proc to ask (not Linux): whether the pid exists at all
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in (b"Z", b"X")


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (the descendants listed first: once the parent is
    gone they would be re-parented and no longer found), and return once they have ended: a caller
    that goes on (a test checking nothing was left behind) must not find one still exiting."""
    killed = [*descendants(pid), pid]
    for each in killed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(each, signal.SIGKILL)
    waited = time.monotonic() + KILL_WAIT_S
    while any(running(each) for each in killed) and time.monotonic() < waited:
        time.sleep(0.01)


def run_watched(
    args: Sequence[str],
    *,
    watch: Iterable[str | Path] = (),
    stall_s: float | None = None,
    input: str | bytes | None = None,
    text: bool = True,
    check: bool = False,
    **popen: Any,
) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True)` with a stall guard in place of a timeout: the
    child (and everything it started) is killed when neither its output nor the files under
    `watch` changed for `stall_s` seconds (default `stall_limit()`), and `Stalled` is raised with
    the output so far. A child that keeps printing or writing runs as long as it needs."""
    process = subprocess.Popen(
        args,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )
    stdout, stderr = communicate_watched(process, watch=watch, stall_s=stall_s, input=input, text=text)
    result = subprocess.CompletedProcess(args, process.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result


def communicate_watched(
    process: subprocess.Popen,
    *,
    watch: Iterable[str | Path] = (),
    stall_s: float | None = None,
    input: str | bytes | None = None,
    text: bool = True,
) -> tuple[Any, Any]:
    """`process.communicate()` under the stall guard of `run_watched`: its output (stdout, and
    stderr unless it goes to stdout) once it has ended; `Stalled` when it stopped making progress."""
    limit = stall_limit(stall_s)
    watched = tuple(Path(p) for p in watch)
    streams = {1: process.stdout, 2: process.stderr}
    chunks: dict[int, list[bytes]] = {1: [], 2: []}
    selector = selectors.DefaultSelector()
    for number, stream in streams.items():
        if stream is not None:
            selector.register(stream, selectors.EVENT_READ, number)
    if process.stdin is not None:
        if input is not None:
            text_stdin = hasattr(process.stdin, "encoding")
            data = input if text_stdin or isinstance(input, bytes) else input.encode()
            with contextlib.suppress(BrokenPipeError):
                process.stdin.write(data)
        process.stdin.close()
    progress = StallWatch(limit, watched)

    def stop() -> None:
        kill_tree(process.pid)
        process.wait()
        raise Stalled(process.args, limit, _decoded(chunks[1], text), _decoded(chunks[2], text), watched)

    try:
        while selector.get_map():
            for key, _ in selector.select(timeout=POLL_S):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.data].append(data)
                    progress.progressed()
                else:
                    selector.unregister(key.fileobj)
            if selector.get_map() and progress.stalled():
                stop()
        while process.poll() is None:  # the pipes closed before it ended: wait the same way
            if progress.stalled():
                stop()
            time.sleep(0.05)
    except BaseException:
        if process.poll() is None:
            kill_tree(process.pid)
            process.wait()
        raise
    finally:
        selector.close()
        for stream in streams.values():
            if stream is not None:
                stream.close()
    return _decoded(chunks[1], text), (_decoded(chunks[2], text) if process.stderr is not None else None)


def wait_for(
    condition: Callable[[], bool],
    watch: Iterable[str | Path],
    *,
    what: str,
    alive: Callable[[], bool] = lambda: True,
    stall_s: float | None = None,
) -> bool:
    """Wait until `condition()` holds, while `alive()` does; True when it held. Stopped with
    `Stalled` (what: the thing waited for) when nothing under `watch` changed for the stall limit."""
    limit = stall_limit(stall_s)
    progress = StallWatch(limit, watch)
    while alive():
        if condition():
            return True
        if progress.stalled():
            raise Stalled(what, limit, watched=progress.paths)
        time.sleep(0.02)
    return condition()


def _decoded(chunks: list[bytes], text: bool) -> Any:
    """The output as `subprocess.run(text=True)` gives it (universal newlines), or the bytes."""
    data = b"".join(chunks)
    return data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n") if text else data


def wait_watched(
    process: subprocess.Popen, watch: Iterable[str | Path], *, stall_s: float | None = None, poll_s: float = POLL_S
) -> int:
    """Wait for `process`, whose output goes to files, while anything under `watch` changes (its
    log, its rows): after `stall_s` seconds without a change it is killed with what it started and
    `Stalled` raised. Returns the exit status."""
    limit = stall_limit(stall_s)
    watched = tuple(Path(p) for p in watch)
    progress = StallWatch(limit, watched, poll_s=poll_s)
    while True:
        try:
            return process.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if progress.stalled():
            kill_tree(process.pid)
            process.wait()
            raise Stalled(process.args, limit, watched=watched)


# ---------------------------------------------------------------------------------------------
# A child's own time, whatever the machine's load (Linux: /proc; elsewhere the wall clock)
# ---------------------------------------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) process `pid` has used so far; None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS


def queued_seconds(pid: int) -> float | None:
    """Seconds the threads of process `pid` have spent runnable but waiting for a CPU, summed
    (schedstat's run delay); None where /proc cannot tell."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total, read = 0, False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as handle:
                total += int(handle.read().split()[1])
                read = True
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9 if read else None


class TargetClock:
    """Seconds charged to a child: wall time less the time its threads queued for a CPU, counted
    interval by interval (an interval is never charged less than nothing). On an idle machine it
    is the wall clock; on a loaded one a target that would finish in 10 s still reads about 10 s,
    while a target blocked for good (asleep, waiting on a lock) is charged every second. Where the
    kernel keeps no run delays it is the wall clock."""

    def __init__(
        self, pid: int, clock: Callable[[], float] = time.monotonic, queued: Callable[[int], float | None] = queued_seconds
    ) -> None:
        self.pid = pid
        self.clock = clock
        self.queued = queued
        self.charged = 0.0
        self._at = clock()
        self._queued = queued(pid)

    def read(self) -> float:
        now, queued = self.clock(), self.queued(self.pid)
        interval = now - self._at
        waited = queued - self._queued if queued is not None and self._queued is not None else 0.0
        self.charged += max(0.0, interval - min(interval, max(0.0, waited)))
        self._at, self._queued = now, queued if queued is not None else self._queued
        return self.charged

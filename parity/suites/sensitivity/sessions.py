"""Isolated pytest sessions without paying for a fresh interpreter each time.

The sensitivity suite runs one pytest session per mutant: a mutant monkeypatches the target, so
it must not share a process with another mutant or with the suites. A fresh `python -m pytest`
per mutant spends most of its time importing torch, pandas and the harness, and it did so 25 times
per run. Here one server process imports all of that once and then, for each session, forks a
child that runs `pytest.main(args)` with its output in a log file: the child starts with every
module imported and nothing else shared (a monkeypatch, a model, a Dynamo cache stays in the child).

Fork safety: the server only imports modules; it runs no torch op and touches no CUDA, so no
thread pool or CUDA context exists to be copied into a child (CUDA must not be initialised before
a fork). The server is started as a subprocess, never forked from the caller, so a caller that
already holds CUDA (the GPU lane's pytest process) is fine.

A child may also run several sessions one after the other (`submit_batch`): one fork, one
collection of the shared imports, and between two sessions an isolation context named in the
request (`parity.suites.sensitivity.isolation.isolated_session` puts patched modules back and
drops built models and compiled frames), so a batch of mutants costs a fraction of one process
each (docs/mutants.md, "How the sessions run").

Several sessions may run at once (`submit` returns a future; `run` waits for one): the server
forks up to `jobs` children at a time, queues the other requests in order, and answers each when
its child exits, in any order. A caller with cores to spare (a serial `parity run` on a 2-core
machine) keeps one child busy beside its own tests and two once it only waits (`set_jobs`).

Closing the server's stdin (`close`, or the caller dying) kills the children still running and
drops the queued requests, so an interrupted or failed run leaves no session behind. The server
ignores SIGINT (a terminal's Ctrl-C reaches the whole process group): each child takes it as a
pytest interrupt, and the caller's teardown closes the server.

Protocol: one JSON object per line on the server's stdin (`{"id": n, "batch": [{"args": [...],
"log": path}, ...], "isolation": "module:function" or null, "codes": path, "stall": s, "watch":
[path, ...]}`), one per line on its stdout when that child ends (`{"id": n, "codes": [exit code per
session]}`: a session the child never finished answers the child's own exit status, 124 when it
was stopped as stalled); the child writes each session's code to the `codes` file as it ends. A
child has no time limit: it is stopped when nothing under `watch` (by default the batch's logs)
has changed for `stall` seconds (docs/cli.md §9). EOF stops the server once its children have ended.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import importlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Imported once by the server, before any fork. Heavy and fork-safe (no threads, no CUDA).
DEFAULT_PRELOAD = ("torch", "numpy", "pandas", "pytest", "xdist", "parity.plugin.hooks")


class ForkServerError(RuntimeError):
    """The server died or answered something that is not a result line."""


class PytestForkServer:
    """A process that has imported the harness once and forks one child per pytest session."""

    def __init__(
        self,
        *,
        cwd: str | Path,
        env: Mapping[str, str] | None = None,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        jobs: int = 1,
        stall: float | None = None,
    ) -> None:
        """`jobs`: how many children run at once; further requests wait in the server, in order.
        `stall`: the stall limit of a request that names none (None: such a child is never stopped)."""
        self.cwd = Path(cwd)
        self.jobs = jobs
        self.stall = stall
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, f"--jobs={jobs}", *preload],
            cwd=self.cwd,
            env=dict(env if env is not None else os.environ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._ids = itertools.count()
        self._pending: dict[int, concurrent.futures.Future[list[int]]] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_answers, name="fork-server-answers", daemon=True)
        self._reader.start()

    def _read_answers(self) -> None:
        process = self._process
        assert process.stdout is not None
        for line in process.stdout:
            try:
                answer = json.loads(line)
                key, codes = int(answer["id"]), [int(code) for code in answer["codes"]]
            except (ValueError, KeyError, TypeError) as error:
                self._fail_all(ForkServerError(f"unexpected answer from the pytest fork server: {line!r}: {error}"))
                return
            with self._lock:
                future = self._pending.pop(key, None)
            if future is not None:
                future.set_result(codes)
        self._fail_all(ForkServerError(f"the pytest fork server exited (code {process.wait()}) with sessions still running"))

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            future.set_exception(error)

    def submit(self, args: Sequence[str], log: str | Path, *, stall: float | None = None) -> concurrent.futures.Future[int]:
        """Start `pytest args` in a forked child (stdout and stderr to `log`); the future gives its exit code."""
        batch = self.submit_batch([(args, log)], stall=stall)
        single: concurrent.futures.Future[int] = concurrent.futures.Future()

        def settle(done: concurrent.futures.Future[list[int]]) -> None:
            error = done.exception()
            if error is not None:
                single.set_exception(error)
            else:
                single.set_result(done.result()[0])

        batch.add_done_callback(settle)
        return single

    def submit_batch(
        self,
        sessions: Sequence[tuple[Sequence[str], str | Path]],
        *,
        isolation: str | None = None,
        stall: float | None = None,
        watch: Sequence[str | Path] = (),
    ) -> concurrent.futures.Future[list[int]]:
        """Run each `(pytest args, log)` in turn in one forked child, `isolation` (a context manager
        factory, `module:function`) around each; the future gives their exit codes in order. The
        child is stopped (124) when nothing under `watch` (default: the logs) changed for `stall`
        seconds; None: never."""
        process = self._process
        if process.poll() is not None:
            raise ForkServerError(f"the pytest fork server exited with code {process.returncode}")
        assert process.stdin is not None
        if not sessions:
            raise ValueError("submit_batch: no session to run")
        future: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
        key = next(self._ids)
        with self._lock:
            self._pending[key] = future
        first_log = Path(sessions[0][1])
        request = {
            "id": key,
            "batch": [{"args": [str(a) for a in args], "log": str(log)} for args, log in sessions],
            "isolation": isolation,
            "codes": str(first_log.with_name(first_log.name + ".codes")),
            "stall": stall if stall is not None else self.stall,
            "watch": [str(p) for p in watch] or [str(log) for _, log in sessions],
        }
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
        except OSError as error:
            with self._lock:
                self._pending.pop(key, None)
            raise ForkServerError(f"the pytest fork server is gone ({error}) while starting {sessions[0][0]}") from error
        return future

    def set_jobs(self, jobs: int) -> None:
        """Run up to `jobs` children at once from now on (queued requests start as slots free)."""
        process = self._process
        assert process.stdin is not None
        try:
            process.stdin.write(json.dumps({"jobs": int(jobs)}) + "\n")
            process.stdin.flush()
        except OSError as error:
            raise ForkServerError(f"the pytest fork server is gone ({error})") from error
        self.jobs = jobs

    def run(self, args: Sequence[str], log: str | Path, *, stall: float | None = None) -> int:
        """Run `pytest args` in a forked child; its stdout and stderr go to `log`. Returns the exit code."""
        return self.submit(args, log, stall=stall).result()

    def close(self) -> None:
        """Stop the server; sessions still running are killed and queued ones dropped (their
        futures fail with ForkServerError)."""
        process = self._process
        if process.poll() is None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                process.wait(timeout=30)  # it kills its children and returns; one that does not is killed
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._reader.join()  # ends at the server's end of output: every pending future has failed by then

    def __enter__(self) -> PytestForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _redirect(log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives until _exit
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _isolation(spec: str | None) -> Any:
    if not spec:
        return contextlib.nullcontext
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _run_child(batch: list[dict[str, Any]], isolation: str | None, codes_path: str) -> None:
    """In the forked child: each session's pytest with its output in its log, `isolation` around
    each; its exit code appended to `codes_path`. Then exit without running the server's atexit
    handlers or flushing its buffers twice."""
    code = 70  # EX_SOFTWARE: pytest itself raised
    codes: list[int] = []
    try:
        sys.stdin = open(os.devnull)  # noqa: SIM115
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it
        import pytest

        around = _isolation(isolation)
        for session in batch:
            _redirect(session["log"])
            code = 70
            try:
                with around():
                    code = int(pytest.main(session["args"]))
            except KeyboardInterrupt:
                raise
            except BaseException as error:
                print(f"forked pytest session raised {type(error).__name__}: {error}", file=sys.stderr)
            codes.append(code)
            sys.stdout.flush()
            sys.stderr.flush()
            with open(codes_path, "w") as out:
                json.dump(codes, out)
        code = 0
    except BaseException as error:
        print(f"forked pytest batch raised {type(error).__name__}: {error}", file=sys.stderr)
        code = 70
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(codes[-1] if len(codes) == len(batch) else code)


def _answer(request: dict[str, Any], status: int) -> list[int]:
    """The codes the child wrote, the child's exit status for the sessions it never finished."""
    try:
        with open(request["codes"]) as source:
            codes = [int(code) for code in json.load(source)]
    except (OSError, ValueError):
        codes = []
    return codes + [status] * (len(request["batch"]) - len(codes))


def serve(preload: Sequence[str], jobs: int = 1) -> None:
    """The server loop: import (or call) `preload`, then fork one child per request line on stdin (at most
    `jobs` at once, the rest queued in order; a `{"jobs": n}` line changes the limit), answer each
    when it ends (stalled, it is killed and answered 124, like timeout(1)). At the end of stdin it
    kills the children still running and returns."""
    import collections
    import selectors

    from parity.observe.progress import StallWatch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in preload:  # `module` is imported; `module:function` is imported and called
        module, _, function = name.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
    # Every object the preload made lives as long as the server: moved out of the collector's reach,
    # a child's collections (pytest's at the end of each session, `drop_session_state`'s between
    # sessions) scan only what the child made. On the CPU lane a tiny mutant's session now costs its
    # tests and about 0.3 s, where it cost about 1.3 s (docs/performance.md §1). `gc.freeze` is the
    # CPython tool for servers that fork.
    gc.freeze()
    answers = sys.stdout
    stdin = sys.stdin.fileno()
    os.set_blocking(stdin, False)
    selector = selectors.DefaultSelector()
    selector.register(stdin, selectors.EVENT_READ)
    running: dict[int, tuple[dict[str, Any], StallWatch | None]] = {}  # pid -> (request, its stall guard)
    queued: collections.deque[dict] = collections.deque()
    buffered = b""
    while True:
        for _key, _events in selector.select(timeout=0.05):
            chunk = os.read(stdin, 65536)
            if not chunk:  # the caller closed the server or died: nobody waits for these sessions
                for pid in running:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                return
            buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            if "jobs" in request:
                jobs = max(1, int(request["jobs"]))
            else:
                queued.append(request)
        while queued and len(running) < jobs:
            request = queued.popleft()
            answers.flush()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(request["codes"])
            pid = os.fork()
            if pid == 0:
                _run_child(request["batch"], request.get("isolation"), request["codes"])
            stall = request.get("stall")
            running[pid] = (request, None if stall is None else StallWatch(float(stall), [*request["watch"], request["codes"]]))
        for pid, (request, guard) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
            elif guard is not None and guard.stalled():
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = 124
            else:
                continue
            del running[pid]
            answers.write(json.dumps({"id": int(request["id"]), "codes": _answer(request, code)}) + "\n")
            answers.flush()


if __name__ == "__main__":
    _jobs = [arg for arg in sys.argv[1:] if arg.startswith("--jobs=")]
    serve([arg for arg in sys.argv[1:] if arg not in _jobs], int(_jobs[-1].split("=", 1)[1]) if _jobs else 1)

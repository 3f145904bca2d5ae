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

Protocol: one JSON object per line on the server's stdin (`{"args": [...], "log": path}`), one per
line on its stdout (`{"code": exit code}`); EOF stops the server.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

# Imported once by the server, before any fork. Heavy and fork-safe (no threads, no CUDA).
DEFAULT_PRELOAD = ("torch", "numpy", "pandas", "pytest", "xdist", "parity.plugin")


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
    ) -> None:
        self.cwd = Path(cwd)
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, *preload],
            cwd=self.cwd,
            env=dict(env if env is not None else os.environ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def run(self, args: Sequence[str], log: str | Path, *, timeout: float | None = None) -> int:
        """Run `pytest args` in a forked child; its stdout and stderr go to `log`. Returns the exit code."""
        process = self._process
        if process.poll() is not None:
            raise ForkServerError(f"the pytest fork server exited with code {process.returncode}")
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps({"args": [str(a) for a in args], "log": str(log), "timeout": timeout}) + "\n")
        process.stdin.flush()
        line = process.stdout.readline()
        if not line:
            raise ForkServerError(f"the pytest fork server died (exit code {process.wait()}) while running {list(args)}")
        try:
            return int(json.loads(line)["code"])
        except (ValueError, KeyError) as error:
            raise ForkServerError(f"unexpected answer from the pytest fork server: {line!r}") from error

    def close(self) -> None:
        process = self._process
        if process.poll() is None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> PytestForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_child(args: list[str], log: str) -> None:
    """In the forked child: pytest with its output in `log`, then exit without running the
    server's atexit handlers or flushing its buffers twice."""
    code = 70  # EX_SOFTWARE: pytest itself raised
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives until _exit
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stdin = open(os.devnull)  # noqa: SIM115
        import pytest

        code = int(pytest.main(args))
    except BaseException as error:
        print(f"forked pytest session raised {type(error).__name__}: {error}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float | None) -> int:
    """Exit code of child `pid`; kill it after `timeout` seconds (reported as 124, like timeout(1))."""
    import signal
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return 124
        time.sleep(0.05)


def serve(preload: Sequence[str]) -> None:
    """The server loop: import `preload`, then fork one child per request line on stdin."""
    for name in preload:
        importlib.import_module(name)
    requests, answers = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        answers.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(request["args"], request["log"])
        code = _wait(pid, request.get("timeout"))
        answers.write(json.dumps({"code": code}) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve(sys.argv[1:])

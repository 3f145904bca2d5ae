"""A pytest plugin (`parity run ... -- -p tests.support.interrupt_plugin`) that lets tests/harness/test_interruptions.py
signal a real run at a known point instead of racing it: the selfcheck suite is over in a fraction
of a second.

Environment:
  PARITY_TEST_PAUSE_DIR     where the markers go (without it the plugin does nothing)
  PARITY_TEST_PAUSE_AFTER   pause after this many tests: `paused` is written, then the test waits
                            for a signal
  PARITY_TEST_HOLD_FINISH   1: when the session finishes, write `finishing` and wait for `go` and
                            for parity's signal watch to have handled the next signal (a second
                            signal lands while the run's end is being recorded)
  PARITY_TEST_BREAK         a broken variant of the harness, to show the tests catch it:
                            `hup-unhandled` (SIGHUP left to its default: the process dies),
                            `every-signal-raises` (a repeated signal raises again, as before)
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

PAUSE_DIR = os.environ.get("PARITY_TEST_PAUSE_DIR")
PAUSE_AFTER = int(os.environ.get("PARITY_TEST_PAUSE_AFTER", "0") or 0)
HOLD_FINISH = os.environ.get("PARITY_TEST_HOLD_FINISH") == "1"
BREAK = os.environ.get("PARITY_TEST_BREAK", "")
_tests_done = 0


def _marker(name: str) -> Path:
    assert PAUSE_DIR is not None
    return Path(PAUSE_DIR) / name


def _wait_for(name: str) -> None:
    """Wait for the test's marker; no time limit of its own (the test's stall guard ends a run
    that hangs here: parity.observe.progress)."""
    while not _marker(name).exists():
        time.sleep(0.02)


def _break_the_harness() -> None:
    from parity.plugin.session import SignalWatch

    if BREAK == "hup-unhandled":
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    elif BREAK == "every-signal-raises":
        watch = SignalWatch.active()
        assert watch is not None, "parity run installs its watch before pytest starts"

        def raise_always(signum: int, frame: Any) -> None:
            watch.received = watch.received or signal.Signals(signum).name
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, raise_always)


def pytest_configure(config: pytest.Config) -> None:
    if PAUSE_DIR and BREAK:
        _break_the_harness()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    global _tests_done
    _tests_done += 1
    if PAUSE_DIR and _tests_done == PAUSE_AFTER:
        _marker("paused").write_text(str(os.getpid()))
        _wait_for("never")  # the signal ends this wait with a KeyboardInterrupt


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if PAUSE_DIR and HOLD_FINISH:
        from parity.plugin.session import SignalWatch

        watch = None if BREAK else SignalWatch.active()  # a broken variant replaced its handlers
        before = watch.repeats if watch is not None else 0
        _marker("finishing").write_text("")
        _wait_for("go")  # the test sent the next signal before it wrote `go`
        while watch is not None and watch.repeats == before:  # handled, not only sent: no race with the clock
            time.sleep(0.02)


# ---------------------------------------------------------------------------------------------
# Used by the tests: a real `parity run` with this plugin, signalled at the pauses above
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SignalledRun:
    code: int
    output: str  # stdout and stderr, interleaved as a terminal shows them
    run_dir: Path


def _wait(path: Path, child: subprocess.Popen[str], watch: Path) -> None:
    """Until the run writes `path` (or ends); stopped when nothing under `watch` changes for the
    stall limit (parity.observe.progress), never after a fixed time."""
    from parity.observe.progress import wait_for

    wait_for(path.exists, [watch], what=f"parity run reaching {path.name}", alive=lambda: child.poll() is None)


def signal_run(tmp_path: Path, *names: str, pause_after: int = 5, broken: str = "", run_id: str = "signalled") -> SignalledRun:
    """`parity run --suite selfcheck` with this plugin, sent the signals `names` (SIGTERM, ...): the
    first while it pauses after `pause_after` tests, each further one while its session finishes
    (a second Ctrl-C while the run's end is recorded). `broken`: PARITY_TEST_BREAK."""
    from parity.observe.progress import communicate_watched
    from tests.support.helpers import PROJECT_ROOT, default_signals, subprocess_env

    pause = tmp_path / "pause"
    pause.mkdir()
    env = {"PARITY_TEST_PAUSE_DIR": str(pause), "PARITY_TEST_PAUSE_AFTER": str(pause_after), "PARITY_TEST_BREAK": broken}
    if len(names) > 1:
        env["PARITY_TEST_HOLD_FINISH"] = "1"
    reports = tmp_path / "reports"
    command = [sys.executable, "-m", "parity", "run", "--suite", "selfcheck", "--report-dir", str(reports), "--run-id", run_id]
    child = subprocess.Popen(
        [*command, "--", "-p", "tests.support.interrupt_plugin"],
        cwd=PROJECT_ROOT,
        env=subprocess_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_signals,
    )
    try:
        _wait(pause / "paused", child, tmp_path)
        child.send_signal(getattr(signal, names[0]))
        for name in names[1:]:
            _wait(pause / "finishing", child, tmp_path)
            child.send_signal(getattr(signal, name))
            (pause / "go").write_text("")  # the session goes on once the signal is handled
        output, _ = communicate_watched(child, watch=[tmp_path])
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    return SignalledRun(child.returncode, output, reports / run_id)

"""Running pytest and the parity CLI in fresh processes, as a user would, and pytest in this
process where what is tested is the plugin's work for one session (about 10 s less a session: no
fresh interpreter importing torch and the plugin)."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[2]


# What `subprocess_env` drops for a child: an in-process session is not one of this run's xdist
# workers either (the plugin reads PYTEST_XDIST_WORKER), nor takes this run's PYTEST_ADDOPTS.
OUTER_SESSION_ENV = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_ADDOPTS")


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    env.pop("PYTEST_ADDOPTS", None)
    env.update(extra)
    return env


def default_signals() -> None:
    """`preexec_fn` for a child that must take Ctrl-C, SIGTERM and a closed terminal (SIGHUP) as a
    foreground command does. A shell without job control starts a background job (`cmd &` in a
    script) with SIGINT ignored (POSIX), `nohup` starts its command with SIGHUP ignored, children
    inherit both, and parity's signal watch takes over only default handlers: a test run that way
    would see the signal it sends do nothing."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def run(args: list[str], *, cwd: Path = PROJECT_ROOT, watch: Iterable[Path] = (), **env: str) -> subprocess.CompletedProcess:
    """`python ARGS` in a fresh process, its output captured. No time limit: the child is stopped
    when it makes no progress (no new output, nothing new under `watch`) for $PARITY_STALL_S
    seconds (`parity.observe.progress`), so a loaded machine makes it slow, never red."""
    return run_command([sys.executable, *args], cwd=cwd, env=subprocess_env(**env), watch=watch, preexec_fn=default_signals)


def run_command(args: list[str], *, watch: Iterable[Path] = (), **popen: Any) -> subprocess.CompletedProcess:
    """Any command, captured, under the same stall guard as `run` (in place of a fixed timeout)."""
    from parity.observe.progress import run_watched

    return run_watched(args, watch=watch, **popen)


def plugin_args() -> list[str]:
    """`-p parity.plugin` where pytest would not load the plugin by itself (a checkout without
    `pip install`: no `pytest11` entry point), nothing where it would."""
    from parity.plugin.options import plugin_load_args

    return plugin_load_args()


def run_pytest(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return run(["-m", "pytest", "-p", "no:cacheprovider", *plugin_args(), *args], **kwargs)


def run_parity(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return run(["-m", "parity", *args], **kwargs)


def _in_process_args() -> list[str]:
    """`run_pytest`'s own arguments, and quiet about the plugin's modules being imported already
    (this process imported them before the session could mark them for assertion rewriting)."""
    return ["-p", "no:cacheprovider", *plugin_args(), "-W", "ignore::pytest.PytestAssertRewriteWarning"]


@contextlib.contextmanager
def _outside_this_session() -> Iterator[None]:
    """An in-process session as a fresh process would see it, and this process as it was after: a
    session refused while parsing its options (pytest calls no hook of it after `pytest_addoption`)
    would leave case-file errors deferred (`parity.cases.defer_errors`) for the tests after it."""
    from parity import cases

    deferring = cases.deferring()
    with pytest.MonkeyPatch.context() as patch:
        for name in OUTER_SESSION_ENV:
            patch.delenv(name, raising=False)
        try:
            yield
        finally:
            cases.defer_errors(deferring)


def run_pytest_in_pytester(pytester: pytest.Pytester, args: list[str]) -> pytest.RunResult:
    """`run_pytest` as an in-process session in `pytester`'s directory (modules it imports are
    dropped afterwards, so test files of the same name in other directories do not clash). Only
    for what one session does (lanes, options, fixtures, up-front checks): never for environment
    variables, thread counts, signals or xdist, which belong to the process."""
    with _outside_this_session():
        return pytester.runpytest_inprocess(*_in_process_args(), *args)


class NoTestRuns:
    """A plugin for an in-process session that must be refused before any test: a test that starts
    ends the session at once (exit status 3, no refusal line), so a broken check fails its test
    quickly instead of running the selected suites inside this process."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> None:
        pytest.exit(f"{item.nodeid} started: the session was not refused before its tests", returncode=3)


def run_pytest_here(args: list[str], *, basetemp: Path, refused: bool = False) -> tuple[int, str]:
    """`run_pytest` as an in-process session of this repository's suites (paths absolute): exit
    status and output (stdout, then stderr). The suite modules it imports stay imported, as any
    import would leave them (`pytester` would drop and re-import them for every session). The
    same limits as `run_pytest_in_pytester`; `refused`: no test may start (`NoTestRuns`)."""
    out, err = io.StringIO(), io.StringIO()
    with _outside_this_session(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = pytest.main([*_in_process_args(), f"--basetemp={basetemp}", *args], plugins=[NoTestRuns()] if refused else [])
    return int(code), out.getvalue() + err.getvalue()


@functools.cache
def _preload() -> None:
    """Every module of the harness and the targets imported once, before the first snapshot: a
    variant may patch a module the process had not imported yet (`isolation.preload`)."""
    from parity.suites.sensitivity.isolation import preload

    preload()


class _NoGcAtUnconfigure:
    """Skip pytest's garbage collection rounds at the end of the session (unraisable exceptions), as
    pytester does for the sessions it runs in process: `drop_session_state` collects once after it."""

    @staticmethod
    def pytest_configure(config: pytest.Config) -> None:
        from _pytest.unraisableexception import gc_collect_iterations_key  # pytester's own knob

        config.stash[gc_collect_iterations_key] = 0


def run_isolated_session(args: list[str], basetemp: Path) -> tuple[int, str]:
    """`python -m pytest <args>` from the project root, as a session of this process: its exit code
    and output (the tail). A fresh interpreter would spend most of a run importing torch and the
    harness again.

    `run_pytest_here` with the isolation a variant needs, as the sensitivity suite
    isolates the sessions it runs in one process (`parity.suites.sensitivity.isolation`): the
    session starts as a fresh process would, with no resident model and no compiled frame; when it
    ends, what it patched in the harness or the target (a variant plugin's module patch) is put
    back and what it built is dropped, and so are the working directory and the environment."""
    from parity.observe.compile_ledger import reset_compile_state
    from parity.suites import conftest as suites_conftest
    from parity.suites.sensitivity.isolation import ModuleSnapshot, drop_session_state

    _preload()
    printed = io.StringIO()
    snapshot = ModuleSnapshot()
    try:
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            patch.chdir(PROJECT_ROOT)
            for name in (*OUTER_SESSION_ENV, "PYTEST_CURRENT_TEST"):
                patch.delenv(name, raising=False)
            patch.setattr(suites_conftest, "RESIDENT", suites_conftest.ResidentModels())
            reset_compile_state()
            args = ["-p", "no:cacheprovider", *plugin_args(), "-W", "ignore::pytest.PytestAssertRewriteWarning", *args]
            code = int(pytest.main([*args, f"--basetemp={basetemp}"], plugins=[_NoGcAtUnconfigure()]))
    finally:
        drop_session_state()  # before the modules are put back: Dynamo's cleanups remove the globals its frames added
        snapshot.restore()
    return code, printed.getvalue()[-6000:]

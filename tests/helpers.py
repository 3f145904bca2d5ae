"""Running pytest and the parity CLI in fresh processes, as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    env.pop("PYTEST_ADDOPTS", None)
    env.update(extra)
    return env


def default_sigint() -> None:
    """`preexec_fn` for a child that must take Ctrl-C as a foreground command does. A shell without
    job control starts a background job (`cmd &` in a script) with SIGINT ignored (POSIX), children
    inherit that, and Python then installs no KeyboardInterrupt handler: a test run that way would
    see its own SIGINT do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(args: list[str], *, cwd: Path = PROJECT_ROOT, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=default_sigint,
    )


def plugin_args() -> list[str]:
    """`-p parity.plugin` where pytest would not load the plugin by itself (a checkout without
    `pip install`: no `pytest11` entry point), nothing where it would."""
    from parity.plugin.options import plugin_load_args

    return plugin_load_args()


def run_pytest(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return run(["-m", "pytest", "-p", "no:cacheprovider", *plugin_args(), *args], **kwargs)


def run_parity(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return run(["-m", "parity", *args], **kwargs)

"""The pytest plugin of the parity harness (registered through the `pytest11` entry point `parity`).

Installed, it loads in every pytest session of the environment, so this module is light: it adds
the `--parity-*` options and the `parity_*` markers and nothing else. The hooks and fixtures of a
parity session (`parity.plugin.hooks`: rows, run directory, lanes, threads, Dynamo resets, the
warning filter, CPU kernel selection) are registered by `activate`, and only in a session that
runs parity tests: one with a `--parity-*` option on its command line (`parity run` always passes
one), one whose ini file sets `parity_scope` (to either value), or one that collects parity's
suites (their conftest activates the plugin). Another project's session imports neither torch nor pandas through parity.
"""

from __future__ import annotations

import pytest

from parity import import_check  # noqa: F401 - first: a shadowed `parity` is one line, not an ImportError deep in the harness

# isort: split
from parity.cases import defer_errors
from parity.plugin import lanes
from parity.plugin.options import add_pytest_options

HOOKS = "parity-session"  # the name `parity.plugin.hooks` is registered under


def pytest_addoption(parser: pytest.Parser) -> None:
    add_pytest_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """`--parity-tp N` in a process no launcher started: start the N ranks through torch's launcher
    instead of running the session here, and answer with rank 0's exit status (parity.plugin.launch)."""
    from parity.plugin import launch

    if not launch.needs_launch(config):
        return None
    return launch.launch(config)


def pytest_configure(config: pytest.Config) -> None:
    lanes.register_markers(config)
    lanes.scope(config)  # a bad ini value is a usage error up front
    if lanes.parity_session(config):
        activate(config)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Every session, parity's or not: collection is over, so a case file read from now on raises
    as ever (the options switched the deferral on, `parity.cases.defer_errors`); a session in the
    same process after this one must not inherit it."""
    defer_errors(False)


def pytest_unconfigure(config: pytest.Config) -> None:
    """And when a session ends before its collection did (a usage error while configuring)."""
    defer_errors(False)


def activate(config: pytest.Config) -> None:
    """Register the parity session's hooks and fixtures (once; later calls do nothing). A session
    whose plugin was switched off (`-p no:parity`: its options were never added) but which collects
    the suites (their conftest calls this) collects nothing and ends with one line (`SwitchedOff`)."""
    if switched_off(config):
        if config.pluginmanager.get_plugin(SwitchedOff.name) is None:
            config.pluginmanager.register(SwitchedOff(), SwitchedOff.name)
        return
    if config.pluginmanager.get_plugin(HOOKS) is None:
        from parity.plugin import hooks

        config.pluginmanager.register(hooks, HOOKS)


def switched_off(config: pytest.Config) -> bool:
    """Whether the session runs without this plugin's options (`-p no:parity`; the suites'
    conftest activates the hooks regardless)."""
    try:
        config.getoption("parity_device")
    except ValueError:
        return True
    return False


class SwitchedOff:
    """The suites collected with the plugin switched off: nothing is collected (every suite needs
    the plugin's options and fixtures), and the session ends with one line and exit 4, a usage error."""

    name = "parity-switched-off"
    message = (
        "the parity suites need the parity plugin, which -p no:parity switched off: leave -p no:parity out to run them "
        "(docs/cli.md §7)"
    )

    @staticmethod
    def pytest_ignore_collect(collection_path: object, config: pytest.Config) -> bool:
        return True

    @staticmethod
    def pytest_collection_finish(session: pytest.Session) -> None:
        pytest.exit(SwitchedOff.message, returncode=pytest.ExitCode.USAGE_ERROR)

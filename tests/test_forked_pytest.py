"""The fork server behind the sensitivity suite: isolated sessions, exit codes, logs, timeouts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from parity.suites.sensitivity.sessions import PytestForkServer

PATCHING_TEST = """
import json, os
def test_patch_stays_here():
    assert not hasattr(json, "parity_leak"), "a previous session's patch leaked into this one"
    json.parity_leak = os.getpid()
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("forked")
    (root / "test_patch.py").write_text(PATCHING_TEST)
    (root / "test_red.py").write_text("def test_red():\n    assert 1 == 2\n")
    (root / "test_slow.py").write_text("import time\ndef test_slow():\n    time.sleep(30)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    with PytestForkServer(cwd=root, env=env, preload=("json",)) as server:
        server.root = root
        yield server


def _args(name: str) -> list[str]:
    return [name, "-q", "-p", "no:cacheprovider"]


def test_each_session_is_isolated_and_reports_its_exit_code(server, tmp_path: Path) -> None:
    # The same module patches json twice: the second session must not see the first one's patch.
    assert server.run(_args("test_patch.py"), tmp_path / "one.log") == 0
    assert server.run(_args("test_patch.py"), tmp_path / "two.log") == 0, (tmp_path / "two.log").read_text()
    assert server.run(_args("test_red.py"), tmp_path / "red.log") == 1
    assert "assert 1 == 2" in (tmp_path / "red.log").read_text()


def test_a_session_past_its_timeout_is_killed(server, tmp_path: Path) -> None:
    assert server.run(_args("test_slow.py"), tmp_path / "slow.log", timeout=1.0) == 124
    assert server.run(_args("test_patch.py"), tmp_path / "after.log") == 0  # the server carries on

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


MEET = """
import pathlib, time
def test_meet():
    here, other = pathlib.Path("{me}.here"), pathlib.Path("{other}.here")
    here.touch()
    deadline = time.monotonic() + 120
    while not other.exists():
        assert time.monotonic() < deadline, "the other session never ran beside this one"
        time.sleep(0.05)
"""


def test_sessions_run_at_once_and_answer_in_any_order(server, tmp_path: Path) -> None:
    """Two sessions that each wait for the other can only both pass if they run at the same time;
    a session submitted after one that is still waiting is answered first (no timing involved)."""
    for me, other in (("a", "b"), ("b", "a"), ("late", "release")):
        (server.root / f"test_meet_{me}.py").write_text(MEET.format(me=me, other=other))
    held = server.submit(_args("test_meet_late.py"), tmp_path / "late.log")  # waits for release.here
    pair = [server.submit(_args(f"test_meet_{me}.py"), tmp_path / f"{me}.log") for me in ("a", "b")]
    assert [future.result(timeout=300) for future in pair] == [0, 0], (tmp_path / "a.log").read_text()
    assert not held.done()  # answered out of order: the later sessions ended first
    (server.root / "release.here").touch()
    assert held.result(timeout=300) == 0

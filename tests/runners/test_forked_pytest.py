"""The fork server behind the sensitivity suite: isolated sessions, exit codes, logs, stalls.

Every server here stops a session that makes no progress for the stall limit
(`parity.observe.progress.stall_limit`): the waits below have no time limit of their own."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from parity.observe.progress import stall_limit, wait_for
from parity.suites.sensitivity.sessions import ForkServerError, PytestForkServer

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
    with PytestForkServer(cwd=root, env=env, preload=("json",), jobs=3, stall=stall_limit()) as server:
        server.root = root
        yield server


def _args(name: str) -> list[str]:
    return [name, "-q", "-p", "no:cacheprovider"]


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_each_session_is_isolated_and_reports_its_exit_code(server, tmp_path: Path) -> None:
    # The same module patches json twice: the second session must not see the first one's patch.
    assert server.run(_args("test_patch.py"), tmp_path / "one.log") == 0
    assert server.run(_args("test_patch.py"), tmp_path / "two.log") == 0, (tmp_path / "two.log").read_text()
    assert server.run(_args("test_red.py"), tmp_path / "red.log") == 1
    assert "assert 1 == 2" in (tmp_path / "red.log").read_text()


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_a_session_that_stalls_is_killed(server, tmp_path: Path) -> None:
    """A session that writes nothing for the stall limit is killed and answered 124 (one that
    keeps writing runs on: tests/harness/test_stall_guard.py shows both on plain children)."""
    assert server.run(_args("test_slow.py"), tmp_path / "slow.log", stall=1.0) == 124
    assert server.run(_args("test_patch.py"), tmp_path / "after.log") == 0  # the server carries on


MEET = """
import pathlib, time
def test_meet():
    here, other = pathlib.Path("{me}.here"), pathlib.Path("{other}.here")
    here.touch()
    while not other.exists():  # a session that never meets the other is stopped as stalled (124)
        time.sleep(0.05)
"""


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_sessions_run_at_once_and_answer_in_any_order(server, tmp_path: Path) -> None:
    """Two sessions that each wait for the other can only both pass if they run at the same time;
    a session submitted after one that is still waiting is answered first (no timing involved)."""
    for me, other in (("a", "b"), ("b", "a"), ("late", "release")):
        (server.root / f"test_meet_{me}.py").write_text(MEET.format(me=me, other=other))
    held = server.submit(_args("test_meet_late.py"), tmp_path / "late.log")  # waits for release.here
    pair = [server.submit(_args(f"test_meet_{me}.py"), tmp_path / f"{me}.log") for me in ("a", "b")]
    assert [future.result() for future in pair] == [0, 0], (tmp_path / "a.log").read_text()
    assert not held.done()  # answered out of order: the later sessions ended first
    (server.root / "release.here").touch()
    assert held.result() == 0


STARTED_THEN_WAITS = """
import os, pathlib, time
def test_wait():
    pathlib.Path("{name}.pid").write_text(str(os.getpid()))
    while not pathlib.Path("{name}.release").exists():  # stopped as stalled if never released
        time.sleep(0.05)
"""


def _wait_for(path: Path) -> None:
    """Until a session writes `path`; a session that hangs first is stopped by the server's stall
    guard, and `wait_for` itself stops when nothing in the directory changes for the limit."""
    wait_for(path.exists, [path.parent], what=f"a session writing {path.name}")


@pytest.fixture
def one_job(tmp_path: Path):
    for name in ("held", "other"):
        (tmp_path / f"test_{name}.py").write_text(STARTED_THEN_WAITS.format(name=name))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    with PytestForkServer(cwd=tmp_path, env=env, preload=("json",), jobs=1, stall=stall_limit()) as server:
        yield server, tmp_path


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_jobs_limit_queues_requests_until_set_jobs(one_job) -> None:
    """With one job a second session waits in the server (its log is only created when it forks);
    raising the limit starts it while the first still runs."""
    server, root = one_job
    held = server.submit(_args("test_held.py"), root / "held.log")
    _wait_for(root / "held.pid")
    other = server.submit(_args("test_other.py"), root / "other.log")
    time.sleep(3)  # ample for a fork: a server that ignored the limit would have started it
    assert not (root / "other.log").exists() and not other.done()
    server.set_jobs(2)
    _wait_for(root / "other.pid")
    (root / "other.release").touch()
    assert other.result() == 0
    assert not held.done()
    (root / "held.release").touch()
    assert held.result() == 0


def test_closing_the_server_kills_running_sessions_and_drops_queued_ones(one_job) -> None:
    """An interrupted run closes the server: no session may outlive it."""
    server, root = one_job
    held = server.submit(_args("test_held.py"), root / "held.log")
    _wait_for(root / "held.pid")
    queued = server.submit(_args("test_other.py"), root / "other.log")
    server.close()
    with pytest.raises(ProcessLookupError):
        os.kill(int((root / "held.pid").read_text()), 0)
    for future in (held, queued):
        with pytest.raises(ForkServerError):
            future.result()  # failed when the server closed
    assert not (root / "other.log").exists()


WATCHED_PATCH = """
import parity.compare.verdict as verdict
def test_patch_{n}():
    assert not hasattr(verdict, "parity_leak"), "a previous session's patch of a parity module leaked into this one"
    verdict.parity_leak = {n}
"""


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_a_batch_runs_its_sessions_in_one_process_each_isolated(tmp_path: Path) -> None:
    """Sessions of one batch share a process (one fork) and still start from the shipped modules:
    `isolation.isolated_session` puts back what a session patched. Without it (the broken
    variant) the second session sees the first one's patch."""
    for n in (1, 2):
        (tmp_path / f"test_watched_{n}.py").write_text(WATCHED_PATCH.format(n=n))
    (tmp_path / "test_pid.py").write_text(
        "import os, pathlib\ndef test_pid():\n    pathlib.Path('pid-' + str(os.getpid())).touch()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]))
    sessions = [
        (_args(name), tmp_path / f"{name}.log")
        for name in ("test_pid.py", "test_watched_1.py", "test_watched_2.py", "test_pid.py")
    ]
    isolation = "parity.suites.sensitivity.isolation:isolated_session"
    with PytestForkServer(cwd=tmp_path, env=env, preload=("parity.compare.verdict",), jobs=1, stall=stall_limit()) as server:
        assert server.submit_batch(sessions, isolation=isolation).result() == [0, 0, 0, 0]
        assert len(list(tmp_path.glob("pid-*"))) == 1, "the batch's sessions ran in one process"
        assert server.submit_batch(sessions[1:3]).result() == [0, 1], (tmp_path / "test_watched_2.py.log").read_text()


def test_a_session_starts_with_the_preload_frozen(server, tmp_path: Path) -> None:
    """The server freezes what it preloaded before it forks (`gc.freeze`): a child's collections
    then scan only what its sessions make (docs/performance.md §1)."""
    (server.root / "test_frozen.py").write_text("import gc\ndef test_frozen():\n    assert gc.get_freeze_count() > 0\n")
    assert server.run(_args("test_frozen.py"), tmp_path / "frozen.log") == 0, (tmp_path / "frozen.log").read_text()

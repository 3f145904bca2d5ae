"""When a run starts the sensitivity suite's sessions early (`parity/suites/sensitivity/runs.py`):
only a serial run (CPU or CUDA) of the serving target with sensitivity tests selected, on all cores but one,
and the server is stopped when the run ends, however it ends."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from parity.suites.sensitivity import runs


class FakeSessions:
    def __init__(self, parallel: int, jobs: int | None, families: frozenset[str] = frozenset()) -> None:
        self.parallel, self.jobs, self.selected, self.closed = parallel, jobs, None, False
        self.families = families
        self.server = SimpleNamespace(jobs=jobs, set_jobs=lambda n: None)
        self.deferred = None

    def start_selected(self, items, tmp_path_factory) -> int:
        self.selected = list(items)
        return len(self.selected)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[FakeSessions]:
    servers: list[FakeSessions] = []

    @contextmanager
    def fake_open(settings, parallel, jobs=None, *, covered=False, families=frozenset()):
        servers.append(FakeSessions(parallel, jobs, families))
        try:
            yield servers[-1]
        finally:
            servers[-1].closed = True

    monkeypatch.setattr(runs.ChildSessions, "open", fake_open)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("PARITY_SENSITIVITY_JOBS", "2")
    return servers


class _Plugins:
    """The plugin manager of a fake session: what `start_early` registers while the run goes on."""

    def __init__(self) -> None:
        self.registered: dict[str, object] = {}

    def register(self, plugin: object, name: str) -> None:
        self.registered[name] = plugin

    def unregister(self, plugin: object) -> None:
        self.registered = {k: v for k, v in self.registered.items() if v is not plugin}


def _item(name: str, index: int) -> SimpleNamespace:
    suite = name.removeprefix("test_").removesuffix(".py")
    marker = SimpleNamespace(args=(suite,))
    return SimpleNamespace(
        path=Path("parity/suites/x") / name,
        nodeid=f"parity/suites/x/{name}::t{index}",
        get_closest_marker=lambda marker_name: marker if marker_name == "parity_suite" else None,
    )


def _session(*names: str) -> SimpleNamespace:
    return SimpleNamespace(
        items=[_item(n, i) for i, n in enumerate(names)], config=SimpleNamespace(stash=pytest.Stash(), pluginmanager=_Plugins())
    )


def _settings(device: str = "cpu", target: str = "serving") -> SimpleNamespace:
    return SimpleNamespace(device=device, target=target, size="tiny", dtype="fp32" if device == "cpu" else "bf16", tp=1)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_serial_run_starts_the_selected_sessions_on_the_spare_cores(device: str, opened) -> None:
    session = _session("test_numerics.py", "test_sensitivity.py")
    with runs.start_early(session, _settings(device), tmp_path_factory=None):
        (server,) = opened
        assert (server.parallel, server.jobs) == (2, 1)  # one core stays with the run's own tests
        if device == "cuda":  # beside the GPU's suites only once numerics has ended
            assert server.selected is None
            (after,) = session.config.pluginmanager.registered.values()
            after.pytest_runtest_logfinish(session.items[0].nodeid, ("", None, ""))
        assert [item.path.name for item in server.selected] == ["test_sensitivity.py"]
        assert session.config.stash[runs.EARLY_SESSIONS] is server
        assert not server.closed
    assert server.closed and runs.EARLY_SESSIONS not in session.config.stash
    assert session.config.pluginmanager.registered == {}


def test_on_cuda_the_sessions_wait_for_the_last_numerics_test(opened) -> None:
    """The GPU lane's children start when its last numerics test ends, not at an earlier one, not
    at another suite's; reaching the sensitivity tests first starts them then (`all_cores`)."""
    session = _session("test_numerics.py", "test_decode.py", "test_numerics.py", "test_sensitivity.py")
    with runs.start_early(session, _settings("cuda"), tmp_path_factory=None):
        (server,) = opened
        (after,) = session.config.pluginmanager.registered.values()
        for item in session.items[:2]:
            after.pytest_runtest_logfinish(item.nodeid, ("", None, ""))
        assert server.selected is None
        after.pytest_runtest_logfinish(session.items[2].nodeid, ("", None, ""))
        assert [item.path.name for item in server.selected] == ["test_sensitivity.py"]
        server.selected = None
        after.pytest_runtest_logfinish(session.items[2].nodeid, ("", None, ""))
        assert server.selected is None  # started once
    session = _session("test_decode.py", "test_sensitivity.py")
    with runs.start_early(session, _settings("cuda"), tmp_path_factory=None):  # no numerics: at once
        assert [item.path.name for item in opened[-1].selected] == ["test_sensitivity.py"]
    session = _session("test_numerics.py", "test_sensitivity.py")
    with runs.start_early(session, _settings("cuda"), tmp_path_factory=None):
        assert opened[-1].selected is None
        runs.ChildSessions.all_cores(opened[-1])  # the sensitivity tests reached
        assert [item.path.name for item in opened[-1].selected] == ["test_sensitivity.py"]


def test_a_failing_or_interrupted_run_still_stops_the_server(opened) -> None:
    session = _session("test_sensitivity.py")
    with pytest.raises(KeyboardInterrupt), runs.start_early(session, _settings(), tmp_path_factory=None):
        raise KeyboardInterrupt
    assert opened[0].closed and runs.EARLY_SESSIONS not in session.config.stash


@pytest.mark.parametrize(
    "case",
    ["xdist worker", "sensitivity deselected", "reference target", "one core"],
)
def test_nothing_starts_early(case: str, opened, monkeypatch: pytest.MonkeyPatch) -> None:
    session, settings = _session("test_numerics.py", "test_sensitivity.py"), _settings()
    if case == "xdist worker":
        monkeypatch.delenv("PARITY_SENSITIVITY_JOBS")
        monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    elif case == "sensitivity deselected":
        session = _session("test_numerics.py")
    elif case == "reference target":
        settings = _settings(target="reference")
    else:
        monkeypatch.setenv("PARITY_SENSITIVITY_JOBS", "1")
    with runs.start_early(session, settings, tmp_path_factory=None):
        assert runs.EARLY_SESSIONS not in session.config.stash
    assert opened == []


@pytest.mark.parametrize("target", ["serving", "examples.minimal_target.parity_target:make_target"])
def test_a_serial_run_of_any_target_starts_its_planted_sessions_early(
    target: str, opened, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planted catalogue (`--parity-mutants`) runs against any target: its sessions start early
    for any of them, the built-in catalogue's only for the built-in target, each with the families
    the target provides (where a planted mutant applies)."""
    monkeypatch.setattr(runs, "run_families", lambda config: frozenset({"ar"}))
    session = _session("test_numerics.py", "test_sensitivity.py", "test_target_mutants.py")
    with runs.start_early(session, _settings(target=target), tmp_path_factory=None):
        (server,) = opened
        names = [item.path.name for item in server.selected]
        expected = ["test_sensitivity.py", "test_target_mutants.py"] if target == "serving" else ["test_target_mutants.py"]
        assert names == expected and server.families == {"ar"}


def test_child_sessions_never_start_sessions_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's environment pins one job, so a child session's own fixture stays idle."""
    seen = {}

    class Server:
        def __init__(self, *, cwd, env, preload, jobs) -> None:
            seen.update(env=env, jobs=jobs)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

    monkeypatch.setattr(runs, "PytestForkServer", Server)
    with runs.ChildSessions.open(_settings(), 2, jobs=1) as children:
        assert children.parallel == 2
    assert seen["jobs"] == 1 and seen["env"]["PARITY_SENSITIVITY_JOBS"] == "1"
    assert seen["env"]["PARITY_PLANTED_ON"] == "serving"  # the target every planted mutant wraps
    monkeypatch.setenv("PARITY_SENSITIVITY_JOBS", seen["env"]["PARITY_SENSITIVITY_JOBS"])
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert runs.parallel_sessions("cpu") == 1

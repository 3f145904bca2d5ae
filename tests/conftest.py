"""Tests of the harness itself belong to the CPU lane whatever --device says (unless marked gpu).

The session's shared runs (`tests/support/shared_run.py`): the tests that read a run of the suites ask for
it through a fixture below; each run those tests need starts in the background before the first
test (one xdist worker makes it, the others wait for it), and the tests that read them run last.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from parity.plugin import lanes
from parity.plugin.short_names import device, report, run_dir, settings, target  # noqa: F401 - this folder's fixture names

# Fixtures shared by several test modules, registered here once (a fixture imported into each
# module would be a separate fixture per module).
from tests.support.ar_support import reference, serving, tiny_dir  # noqa: F401
from tests.support.shared_run import (
    EXAMPLE,
    EXAMPLE_QUICK,
    EXAMPLE_TP2,
    LANE,
    MINIMAL,
    QUICK_LANE,
    QUICK_SHARD_1,
    QUICK_SHARD_2,
    REFERENCE,
    SUITES_BUT_SENSITIVITY,
    TP2,
    SharedRun,
    SharedRuns,
    shared_root,
)

pytest_plugins = ["pytester"]  # in-process pytest sessions for the plugin's own tests

_HERE = Path(__file__).resolve().parent
# fixture -> the run it reads; `suites_run` is read from the lane run when the session makes one
SHARED_RUN_FIXTURES = {
    "lane_run": LANE,
    "suites_run": SUITES_BUT_SENSITIVITY,
    "example_run": EXAMPLE,
    "reference_run": REFERENCE,
    "minimal_run": MINIMAL,
    "tp_run": TP2,
    "example_tp_run": EXAMPLE_TP2,
    "example_quick_run": EXAMPLE_QUICK,
    "quick_lane_run": QUICK_LANE,
    "quick_shard_1": QUICK_SHARD_1,
    "quick_shard_2": QUICK_SHARD_2,
}


def _reads_a_shared_run(item: pytest.Item) -> bool:
    return bool(set(getattr(item, "fixturenames", ())) & set(SHARED_RUN_FIXTURES))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        in_tests = _HERE in Path(str(item.path)).resolve().parents
        if in_tests and item.get_closest_marker(lanes.GPU) is None and item.get_closest_marker(lanes.CPU) is None:
            item.add_marker(lanes.CPU)
        if _reads_a_shared_run(item):
            item.add_marker("shared_run")  # the fast loop leaves these out: `-m "... and not shared_run"`
    items.sort(key=_reads_a_shared_run)  # the readers last: the runs they read go on meanwhile


@pytest.fixture(scope="session", autouse=True)
def shared_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedRuns | None]:
    """Start, before this process's first test, every shared run a selected test reads; at the end
    wait for the runs this process started."""
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ()) if name in SHARED_RUN_FIXTURES}
    if not wanted:
        yield None
        return
    runs = SharedRuns(shared_root(tmp_path_factory.getbasetemp()))
    specs = [SHARED_RUN_FIXTURES[name] for name in sorted(wanted)]
    for spec in specs:
        if not any(other is not spec and other.covers(spec) for other in specs):
            runs.start(spec)
    try:
        yield runs
    finally:
        runs.join()


def _read(runs: SharedRuns | None, fixture: str) -> SharedRun:
    assert runs is not None, f"{fixture}: the shared runs were not set up"
    return runs.get(SHARED_RUN_FIXTURES[fixture])


@pytest.fixture(scope="session")
def lane_run(shared_runs: SharedRuns | None) -> SharedRun:
    """The CPU lane's run of the built-in target: every suite, sensitivity included (`parity run`)."""
    return _read(shared_runs, "lane_run")


@pytest.fixture(scope="session")
def suites_run(shared_runs: SharedRuns | None) -> SharedRun:
    """Every suite but sensitivity on the built-in target: the lane run when this session makes it."""
    return _read(shared_runs, "suites_run")


@pytest.fixture(scope="session")
def example_run(shared_runs: SharedRuns | None) -> SharedRun:
    """The example engine (examples/engine_target) through every AR suite."""
    return _read(shared_runs, "example_run")


@pytest.fixture(scope="session")
def minimal_run(shared_runs: SharedRuns | None) -> SharedRun:
    """The AR-only minimal example (examples/minimal_target) through `parity run --target`, no suite named."""
    return _read(shared_runs, "minimal_run")


@pytest.fixture(scope="session")
def reference_run(shared_runs: SharedRuns | None) -> SharedRun:
    """`--target reference --quick` through every suite but sensitivity."""
    return _read(shared_runs, "reference_run")


@pytest.fixture(scope="session")
def tp_run(shared_runs: SharedRuns | None) -> SharedRun:
    """The built-in target tensor-parallel over 2 ranks (gloo): every suite, `parity run --tp 2`."""
    return _read(shared_runs, "tp_run")


@pytest.fixture(scope="session")
def example_tp_run(shared_runs: SharedRuns | None) -> SharedRun:
    """The example engine's TP=2 variant (examples/engine_target/engine_tp.py) through every AR suite, quick lane."""
    return _read(shared_runs, "example_tp_run")


@pytest.fixture(scope="session")
def example_quick_run(shared_runs: SharedRuns | None) -> SharedRun:
    """The example engine in one process through every AR suite, quick lane (what its TP=2 run is compared with)."""
    return _read(shared_runs, "example_quick_run")


@pytest.fixture(scope="session")
def quick_lane_run(shared_runs: SharedRuns | None) -> SharedRun:
    """The quick lane on one machine (`parity run --quick`, every suite but sensitivity, which it leaves out)."""
    return _read(shared_runs, "quick_lane_run")


@pytest.fixture(scope="session")
def quick_shard_1(shared_runs: SharedRuns | None) -> SharedRun:
    """The quick lane's first of two shards (`parity run --quick --shard 1/2`)."""
    return _read(shared_runs, "quick_shard_1")


@pytest.fixture(scope="session")
def quick_shard_2(shared_runs: SharedRuns | None) -> SharedRun:
    """The quick lane's second of two shards (`parity run --quick --shard 2/2`)."""
    return _read(shared_runs, "quick_shard_2")

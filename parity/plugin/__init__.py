"""The pytest plugin of the parity harness (registered through the `pytest11` entry point `parity`).

Hooks only; the pieces live beside it: `options` (the `--parity-*` options, shared with `parity
run`), `session` (the run a session belongs to, its run directory and writer), `report_fixture`
(the `report` fixture a suite writes rows through, and the other fixtures), `lanes` (markers, which
tests the plugin acts on, threads, GPU pinning). The plugin turns a recorded failing row into a
failed test, a check that raised into an `error` row and a failed setup into an `error` row, so
the CSV holds every outcome. Under pytest-xdist the controller chooses the run directory and hands
it to the workers; every process appends to the same `results.csv` (see `parity.report`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from parity import env
from parity.cases import CaseFileError, add_case_dirs
from parity.compare import ERROR, FAIL
from parity.plugin import lanes
from parity.plugin.options import add_pytest_options
from parity.plugin.report_fixture import (  # noqa: F401 - fixtures are found in the plugin's namespace
    REPORT,
    SESSION,
    WRITER,
    SuiteReport,
    default_case,
    device,
    fresh_compile_state,
    report,
    run_dir,
    settings,
    target,
)
from parity.plugin.session import WORKER_RUN_DIR, RunSession, option
from parity.report import RESULTS_FILE, RUN_INFO_FILE, add_suite_seconds, format_summary, read_results, summarize


def pytest_addoption(parser: pytest.Parser) -> None:
    add_pytest_options(parser)


class _XdistHooks:
    """Registered only when pytest-xdist is active: hands the run directory to every worker."""

    def __init__(self, config: pytest.Config):
        self.config = config

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[WORKER_RUN_DIR] = str(self.config.stash[SESSION].run_dir)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    lanes.register_markers(config)
    lanes.scope(config)  # a bad ini value is a usage error up front
    # oneDNN's ISA follows a forced ATEN_CPU_CAPABILITY and Inductor gets a cache per kernel set
    # (docs/cpu-kernels.md); only acts when ATEN_CPU_CAPABILITY is set, before any kernel runs.
    env.select_cpu_kernels()
    session = RunSession.from_config(config)
    if session.device == "cuda":
        lanes.pin_xdist_worker_to_gpu()  # before anything initialises CUDA
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--parity-device cuda: no CUDA device is available on this machine")
    add_case_dirs(session.cases_dirs)
    config.stash[SESSION] = session
    config.stash[WRITER] = session.writer(config)
    if not _is_worker(config):
        config.pluginmanager.register(_SuiteClock(config), "parity-suite-clock")
        if config.pluginmanager.hasplugin("xdist"):
            config.pluginmanager.register(_XdistHooks(config), "parity-xdist")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The CPU kernel set and thread count of a parity session (one that uses `--parity-*` options
    or runs under `parity_scope = all`), and a note whenever parity capped oneDNN."""
    kernels = env.cpu_kernels()
    lines = [f"parity: {kernels['note']}"] if "note" in kernels else []
    parity_session = lanes.scope(config) == "all" or any(str(a).startswith("--parity-") for a in config.invocation_params.args)
    if option(config, "device") == "cpu" and parity_session:
        chosen = " ".join(f"{k}={v}" for k, v in kernels.items() if k in env.CPU_KERNEL_ENV and v)
        line = f"parity: CPU kernels {kernels['cpu_capability']}, {lanes.cpu_threads()} thread(s)" + (
            f"; {chosen}" if chosen else ""
        )
        lines.insert(0, line)
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give unmarked parity tests the lane of --parity-device, apply --parity-suite, and set the
    CPU lane's thread count when parity tests run in this process."""
    session = config.stash[SESSION]
    lanes.mark_lanes(items, session.device)
    wanted = set(session.suites)
    if wanted:
        keep, drop = [], []
        for item in items:
            (keep if lanes.suite_of(item) in wanted else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    if session.device == "cpu" and any(lanes.is_parity_test(item) for item in items):
        lanes.set_cpu_threads()


SUITE_PROPERTY = "parity_suite"  # a test report's user property naming its report suite (xdist sends it along)
SUITE_SECONDS = pytest.StashKey[dict]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    suite = lanes.suite_of(item)
    if suite is not None and (SUITE_PROPERTY, suite) not in item.user_properties:
        item.user_properties.append((SUITE_PROPERTY, suite))
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("gpu test: no CUDA device on this machine (torch.cuda.is_available() is False)")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[Any]:
    """A malformed case file is one readable line (file, table, key), not a loader traceback."""
    collected = yield
    if collected.failed and collected.longrepr is not None:
        marker = f"{CaseFileError.__name__}: "
        lines = [line for line in str(collected.longrepr).splitlines() if marker in line]
        if lines:
            collected.longrepr = lines[-1].split(marker, 1)[1].strip()
    return collected


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Every failure reaches the CSV: a raised check becomes an `error` row, a bare assert a `fail`
    row, and a recorded failing row fails a test that would otherwise have passed."""
    try:
        result = yield
    except BaseException as exc:
        rep = item.stash.get(REPORT, None)
        if rep is not None and not rep.failures and not isinstance(exc, (pytest.skip.Exception, KeyboardInterrupt)):
            is_assert = isinstance(exc, AssertionError)
            message = f"{type(exc).__name__}: {exc}".strip()
            rep.record(
                metric="assertion" if is_assert else "exception",
                value=None,
                verdict=FAIL if is_assert else ERROR,
                detail=message.replace("\n", " | ")[:2000],
            )
        raise
    rep = item.stash.get(REPORT, None)
    if rep is not None and rep.failures:
        raise AssertionError(rep.failure_text())
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[Any]:
    """A suite test whose setup failed (a model that would not load, a fixture that raised) still
    leaves an `error` row, so a run's CSV accounts for every test of a suite."""
    outcome = yield
    suite = lanes.suite_of(item)
    if outcome.when == "setup" and outcome.failed and suite and call.excinfo is not None:
        exc = call.excinfo.value
        message = f"setup failed: {type(exc).__name__}: {exc}".replace("\n", " | ")[:2000]
        item.config.stash[WRITER].write(
            {
                "suite": suite,
                "case": default_case(item),
                "metric": "exception",
                "value": None,
                "verdict": ERROR,
                "detail": message,
                "test": item.nodeid,
            }
        )
    return outcome


class _SuiteClock:
    """Seconds per report suite: setup, call and teardown of its tests, summed. Registered on the
    controller, where every xdist worker's reports arrive (the suite travels as a user property);
    serially the sum is the suite's wall time, under xdist its test time across workers."""

    def __init__(self, config: pytest.Config) -> None:
        self.seconds = config.stash[SUITE_SECONDS] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:  # noqa: F811 - pytest's hook argument name
        suite = dict(report.user_properties).get(SUITE_PROPERTY)
        if suite is not None:
            self.seconds[suite] = self.seconds.get(suite, 0.0) + float(report.duration)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the seconds per suite into run.json (the controller; the run directory must exist)."""
    config = session.config
    seconds = config.stash.get(SUITE_SECONDS, None)
    run = config.stash.get(SESSION, None)
    if _is_worker(config) or not seconds or run is None or not (run.run_dir / RUN_INFO_FILE).exists():
        return
    add_suite_seconds(run.run_dir, seconds)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _is_worker(config) or config.getoption("parity_no_summary"):
        return
    session = config.stash.get(SESSION, None)
    if session is None or not (session.run_dir / RESULTS_FILE).exists():
        return
    frame = read_results(session.run_dir)
    terminalreporter.section("parity report")
    terminalreporter.write_line(format_summary(summarize(frame, config.stash.get(SUITE_SECONDS, None))))
    terminalreporter.write_line(f"{len(frame)} rows in {session.run_dir / RESULTS_FILE}")

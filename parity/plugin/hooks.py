"""The hooks of a parity session: registered by `parity.plugin.activate` only in sessions that run
parity tests, so another project's pytest never imports torch or pandas through parity.

Hooks only; the pieces live beside it: `options` (the `--parity-*` options, shared with `parity
run`), `session` (the run a session belongs to, its run directory and writer), `report_fixture`
(the `report` fixture a suite writes rows through, and the other fixtures), `lanes` (markers, which
tests the plugin acts on, threads, GPU pinning). The plugin turns a recorded failing row into a
failed test, a check that raised into an `error` row and a failed setup into an `error` row, so
the CSV holds every outcome; a skipped suite test leaves a `skip` row with pytest's reason. Under pytest-xdist the controller chooses the run directory and hands
it to the workers; every process appends to the same `results.csv` (see `parity.report`).

Mistakes in the options stop the session before any test with one `ERROR:` line and exit status
4: the target is resolved once, up front, as soon as a parity test is selected; an unknown
`--parity-suite` names the suites that exist. Under xdist a worker cannot stop the session by
itself, so it selects nothing and hands its line to the controller, which prints it. The process
that runs the session records its end in `run.json` (`session.finish_run`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import sys
import traceback
import types
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from parity import env
from parity.cases import CaseFileError, add_case_dirs, defer_errors, unreadable_case_files
from parity.compare import ERROR, FAIL, SKIP
from parity.observe.origin import error_line
from parity.plugin import lanes, live, ranks, shards
from parity.plugin import report_fixture as report_fixture_module
from parity.plugin.report_fixture import (  # noqa: F401 - fixtures are found in the plugin's namespace
    REPORT,
    SESSION,
    WRITER,
    SuiteReport,
    default_case,
    parity_device,
    parity_fresh_compile_state,
    parity_report,
    parity_run_dir,
    parity_settings,
    parity_target,
)
from parity.plugin.resume import ResumePlan, drop_rows, plan_resume
from parity.plugin.session import (
    TARGET_INTERRUPTED,
    WORKER_CONTROLLER_PID,
    WORKER_RUN_DIR,
    RunDirError,
    RunSession,
    SignalWatch,
    finish_run,
    option,
    probe_report_dir,
    session_target,
    unwritten_text,
)
from parity.report import (
    RESULTS_FILE,
    RUN_INFO_FILE,
    add_suite_seconds,
    format_summary,
    read_results,
    summarize,
    update_run_info,
)
from parity.report.case_lines import failing_cases_text
from parity.report.rows import RowNotWritten
from parity.target import PLANTED_SUITE, TargetError

USAGE_ERRORS = pytest.StashKey[list[str]]()
REFUSED = pytest.StashKey[str]()  # the line this process refused the session with, before any test
SIGNALS = pytest.StashKey[SignalWatch]()
OWN_SIGNALS = pytest.StashKey[bool]()  # whether this session installed the watch (not `parity run`'s)
RESUMED = pytest.StashKey[dict[str, Any]]()  # run.json of an --parity-append'ed run before this session
RESUME = pytest.StashKey[ResumePlan]()  # what an --parity-append'ed session skips and reruns
RESUMED_ITEMS = pytest.StashKey[list]()  # the tests an appended session deselected: they already hold rows
UNWRITTEN = pytest.StashKey[dict[str, Any]]()  # rows xdist workers could not write: count, error, tests
WORKER_USAGE_ERROR = "parity_usage_error"  # key of a worker's one-line usage error in its workeroutput
WORKER_RESUME_DONE = "parity_resume_done"  # workerinput: node ids an appended run already holds rows of
WORKER_UNWRITTEN = "parity_unwritten"  # workeroutput: [count, first error, tests] of rows the disk refused


ADDOPTS = "PYTEST_ADDOPTS"


def _workers_use_this_configuration(config: pytest.Config) -> None:
    """A worker decides its rootdir and ini file before any plugin's options are known, from the
    controller's command line: the value of `--parity-report-dir DIR` (spelt with a space) then reads
    as a test path, and once the controller has made DIR the worker roots itself there and loses
    the project's ini (`parity_scope`, markers, testpaths): measured, `-n 2 -m cpu` selected no test.
    Workers read PYTEST_ADDOPTS first and inherit this process's environment, so it carries the
    controller's rootdir and ini file to them."""
    extra = [f"--rootdir={config.rootpath}"] + ([f"--config-file={config.inipath}"] if config.inipath else [])
    os.environ[ADDOPTS] = " ".join(filter(None, [os.environ.get(ADDOPTS, ""), *map(shlex.quote, extra)]))


class _XdistHooks:
    """Registered only when pytest-xdist is active: hands the run directory to every worker."""

    def __init__(self, config: pytest.Config):
        self.config = config
        if config.getoption("numprocesses", None):
            _workers_use_this_configuration(config)

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[WORKER_RUN_DIR] = str(self.config.stash[SESSION].run_dir)
        node.workerinput[WORKER_CONTROLLER_PID] = self.config.stash[SESSION].controller_pid
        plan = self.config.stash.get(RESUME, None)
        if plan is not None:  # decided once, here: every worker must deselect the same tests
            node.workerinput[WORKER_RESUME_DONE] = sorted(plan.done)

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        count, why, tests = getattr(node, "workeroutput", {}).get(WORKER_UNWRITTEN, (0, "", []))
        if count:
            unwritten = self.config.stash.setdefault(UNWRITTEN, {"count": 0, "error": "", "tests": set()})
            unwritten["count"] += int(count)
            unwritten["error"] = unwritten["error"] or str(why)
            unwritten["tests"] |= set(tests)
        message = getattr(node, "workeroutput", {}).get(WORKER_USAGE_ERROR)
        errors = self.config.stash.setdefault(USAGE_ERRORS, [])
        if message and message not in errors:
            errors.append(message)


class _ShardHooks:
    """`--parity-shard K/N` (parity.plugin.shards): after every other selection, keep this shard's
    part, and record in run.json which part of which selection it is."""

    def __init__(self, shard: shards.Shard) -> None:
        self.shard = shard

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
        result = yield
        if REFUSED in config.stash or not items:
            return result
        selection = [*items, *config.stash.get(RESUMED_ITEMS, [])]
        plan, _, drop = shards.plan(selection, self.shard)
        config.stash[shards.SHARD] = plan
        dropped = {id(item) for item in drop}
        if dropped:
            config.hook.pytest_deselected(items=[item for item in items if id(item) in dropped])
            items[:] = [item for item in items if id(item) not in dropped]
        run_dir = config.stash[SESSION].run_dir
        if (run_dir / RUN_INFO_FILE).is_file():  # made by a row written while collecting (a family not provided)
            update_run_info(run_dir, shard=plan.record())
        return result


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def usage_error(config: pytest.Config, message: str, items: list[pytest.Item]) -> None:
    """Stop the session before any test with one line: a `pytest.UsageError` (pytest prints
    `ERROR: <message>`, exit status 4); in an xdist worker, where that would be an INTERNALERROR,
    select nothing and hand the line to the controller (`pytest_testnodedown`, `pytest_sessionfinish`)."""
    if _is_worker(config):
        config.workeroutput[WORKER_USAGE_ERROR] = message  # type: ignore[attr-defined]  # pytest-xdist sets it on a worker's config
        config.hook.pytest_deselected(items=list(items))
        items.clear()
        return
    config.stash[REFUSED] = message  # pytest still calls pytest_collection_finish (a `finally`)
    raise pytest.UsageError(message)


class _InterruptRepr:
    """pytest formats the interrupted traceback in `pytest_keyboard_interrupt`. On Python 3.11 a
    signal that lands where a frame has no line number (`tb_lineno` None) makes that formatting
    raise TypeError (the trace in pytest-dev/pytest-xdist#1196), and pytest's own traceback would
    replace the run's end: the summary and the line that say the run is interrupted. Then Python's
    own formatting of the traceback (which takes a missing line number) stands in for pytest's."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(wrapper=True)
    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> Iterator[None]:
        try:
            return (yield)
        except TypeError:
            terminal = self.config.pluginmanager.get_plugin("terminalreporter")
            if terminal is not None:  # pytest reports the interruption from this memo at the session's end
                from _pytest._code.code import ReprExceptionInfo, ReprFileLocation, ReprTracebackNative

                lines = traceback.format_exception(excinfo.value)
                crash = ReprFileLocation(
                    path="", lineno=0, message=f"{type(excinfo.value).__name__} (pytest could not format it)"
                )
                terminal._keyboardinterrupt_memo = ReprExceptionInfo(reprtraceback=ReprTracebackNative(lines), reprcrash=crash)
            return None


def pytest_configure(config: pytest.Config) -> None:
    lanes.ignore_torch_warnings(config)
    config.pluginmanager.register(_InterruptRepr(config), "parity-interrupt-repr")
    # oneDNN's ISA follows a forced ATEN_CPU_CAPABILITY and Inductor gets a cache per kernel set
    # (docs/cpu-kernels.md); only acts when ATEN_CPU_CAPABILITY is set, before any kernel runs.
    env.select_cpu_kernels()
    # A tensor-parallel rank meets the others first: a peer writes inside the run directory rank 0 chooses.
    group = None if _is_worker(config) else ranks.configure(config, option(config, "tp"), option(config, "device"))
    try:
        session = RunSession.from_config(config, run_dir=group.peer_run_dir() if group is not None and group.rank else None)
    except pytest.UsageError as exc:
        if group is not None and group.rank == 0:
            group.publish_run_dir(None, refused=str(exc))
        raise
    if group is not None:
        _join_the_run(config, group, session)
    if session.device == "cuda":
        lanes.pin_xdist_worker_to_gpu()  # before anything initialises CUDA
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--parity-device cuda: no CUDA device is available on this machine")
        if session.dtype == "fp32":
            # fp32 means IEEE fp32: cuDNN convolutions default to TF32 (10-bit mantissa), which would
            # put half-precision noise into the decoder of an "fp32" run; the catalogue's fp32 kills
            # on the CUDA lane (defects invisible at bf16) assume fp32 rounding.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
    add_case_dirs(session.cases_dirs)
    config.stash[SESSION] = session
    config.stash[WRITER] = session.writer(config)
    if session.append and not _is_worker(config) and (session.run_dir / RESULTS_FILE).is_file():
        config.stash[RESUME] = plan_resume(session.run_dir)
    shard = option(config, "shard")
    if shard:
        try:
            config.pluginmanager.register(_ShardHooks(shards.parse_shard(shard, "--parity-shard")), "parity-shard")
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
    if not _is_worker(config):
        config.pluginmanager.register(_SuiteClock(config), "parity-suite-clock")
        config.pluginmanager.register(live.LiveVerdicts(config), "parity-live-verdicts")
        if config.pluginmanager.hasplugin("xdist"):
            config.pluginmanager.register(_XdistHooks(config), "parity-xdist")


def _join_the_run(config: pytest.Config, group: ranks.RankGroup, session: RunSession) -> None:
    """Rank 0 tells the peers where the run is and, should its main thread never come back from a
    broken group, lets the heartbeat record the run's end; every rank lets the peers go at its end."""
    if group.rank == 0:
        group.publish_run_dir(session.run_dir)

        def record_end(why: str) -> None:
            finish_run(
                session.run_dir, pytest.ExitCode.INTERRUPTED, signal_name=None, stopped=f"tensor-parallel group broken: {why}"
            )

        group.on_last_resort = record_end
    config.add_cleanup(group.release)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The CPU kernel set and thread count of a parity session on the CPU, and a note whenever
    parity capped oneDNN."""
    kernels = env.cpu_kernels()
    lines = [f"parity: {kernels['note']}"] if "note" in kernels else []
    if option(config, "device") == "cpu":
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
    lanes.mark_lanes(items, session.device, short=lanes.short_lanes(config))
    _planted_only_with_mutants(config, items, session.mutants)
    # --mutants beside a --suite selection: the planted catalogue runs too (docs/cli.md)
    wanted = set(session.suites) | ({PLANTED_SUITE} if session.mutants and session.suites else set())
    known = {suite for item in items if (suite := lanes.suite_of(item)) is not None}
    unknown = sorted(wanted - known)
    if unknown:
        listed = ", ".join(sorted(known)) or "none (no parity test was collected)"
        usage_error(
            config,
            f"--parity-suite {', '.join(map(repr, unknown))}: no such suite among the collected tests; suites: {listed}",
            items,
        )
        return
    if wanted:
        keep: list[pytest.Item] = []
        drop: list[pytest.Item] = []
        for item in items:
            (keep if lanes.suite_of(item) in wanted else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    if session.quick:  # the quick lane's tests only, compiled without code generation (docs/cli.md §11)
        from parity.observe.dynamic import generate_no_code
        from parity.plugin.quick import QuickPlanError, select

        try:
            plan = select(config, items)
        except QuickPlanError as exc:
            usage_error(config, str(exc), items)
            return
        generate_no_code(plan.lane.compile_backend)
        config.add_cleanup(lambda: generate_no_code(None))  # a later session in this process compiles as ever
    _deselect_resumed(config, items)
    # A case file that could not be read stops the session only when a selected test reads it
    # (parity.cases.unreadable_case_files): one line, exit 4, whatever else is broken elsewhere.
    unreadable = unreadable_case_files(item.path for item in items)
    if unreadable:
        usage_error(config, unreadable, items)
        return
    if session.device == "cpu" and any(lanes.is_parity_test(item) for item in items):
        lanes.set_cpu_threads()


def _planted_only_with_mutants(config: pytest.Config, items: list[pytest.Item], mutants: bool) -> None:
    """The planted catalogue (`target_mutants`) runs only when asked for (`--parity-mutants`): left
    out without a row, as the benchmarks are without their marker."""
    if mutants:
        return
    drop = [item for item in items if lanes.suite_of(item) == PLANTED_SUITE]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if lanes.suite_of(item) != PLANTED_SUITE]


def resumed_test_ids(config: pytest.Config) -> set[str]:
    """The `test` ids whose rows an appended run already holds (`parity.plugin.resume`: decided by
    the controller, handed to xdist workers); empty for a new run."""
    if _is_worker(config):
        return set(config.workerinput.get(WORKER_RESUME_DONE, ()))  # type: ignore[attr-defined]  # pytest-xdist sets it on a worker's config
    plan = config.stash.get(RESUME, None)
    return set(plan.done) if plan is not None else set()


def writes_session_rows(config: pytest.Config) -> bool:
    """Whether this process writes the rows a session writes once (not per test): the serial
    session, or the first xdist worker (every worker collects the same tests); of a sharded run,
    only shard 1 (the merged run holds them once)."""
    shard = option(config, "shard")
    if shard and shards.parse_shard(shard, "--parity-shard").index != 1:
        return False
    return not _is_worker(config) or config.workerinput.get("workerid") == "gw0"  # type: ignore[attr-defined]  # pytest-xdist sets it on a worker's config


def _deselect_resumed(config: pytest.Config, items: list[pytest.Item]) -> None:
    """An appended session does not run again the tests whose rows the run already holds."""
    done = resumed_test_ids(config)
    if not done:
        return
    skip = [item for item in items if item.nodeid in done]
    config.stash[RESUMED_ITEMS] = skip  # still part of the selection a shard is cut from
    if skip:
        config.hook.pytest_deselected(items=skip)
        items[:] = [item for item in items if item.nodeid not in done]


def _drop_resumed_rows(config: pytest.Config) -> None:
    """Once per session, when its tests are about to run: drop the rows of the tests the resumed run
    may hold half-written (and its torn records), so their rows are not recorded twice. Whether or
    not they are selected now: a test without rows is missing, and runs whenever it is selected."""
    plan = config.stash.get(RESUME, None)
    if plan is not None and plan.changes_results:
        drop_rows(plan)
        config.stash[RESUME] = dataclasses.replace(plan, dropped_rows=0, torn=0)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """The session is past collection and its up-front checks: a resumed run's half-written rows go
    now, before any test (an xdist controller schedules none before its own loop, which follows)."""
    if not _is_worker(session.config):
        _drop_resumed_rows(session.config)


SUITE_PROPERTY = "parity_suite"  # a test report's user property naming its report suite (xdist sends it along)
SUITE_SECONDS = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Resolve the target once, up front, when a parity test is selected, and make sure the report
    directory can be written: a bad `--parity-target` or `--parity-report-dir` is one line before
    any test runs, never one traceback per test or an INTERNALERROR at the first row."""
    defer_errors(False)  # collection is over: a case file read by a test raises as ever
    if REFUSED in session.config.stash:  # refused in pytest_collection_modifyitems: nothing is touched
        return
    if session.config.stash.get(TARGET_INTERRUPTED, False):  # pytest calls this hook while the interruption unwinds
        return
    if any(lanes.is_parity_test(item) for item in session.items):
        try:
            session_target(session.config)
            probe_report_dir(session.config.stash[SESSION].run_dir.parent, "--parity-report-dir")
        except (TargetError, RunDirError) as exc:
            usage_error(session.config, str(exc), session.items)
            return
        _watch_signals(session.config)


def _watch_signals(config: pytest.Config) -> None:
    """In the process that records the run's end (not an xdist worker), once per session: the watch
    `parity run` installed for its whole command, or one of the session's own."""
    if not _is_worker(config) and SIGNALS not in config.stash:
        outer = SignalWatch.active()
        config.stash[SIGNALS] = outer or SignalWatch().install()
        config.stash[OWN_SIGNALS] = outer is None


def pytest_sessionstart(session: pytest.Session) -> None:
    """A parity session watches for SIGINT, SIGTERM and SIGHUP from the start (the xdist controller
    collects nothing itself); an appended run goes back to `running`."""
    config = session.config
    if _is_worker(config) or SESSION not in config.stash:
        return
    _watch_signals(config)
    group = config.stash.get(ranks.GROUP, None)
    if group is not None:
        group.session = session  # a broken group stops the session after the test in flight
    plan = config.stash.get(RESUME, None)
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if plan is not None and terminal is not None:  # said even under -q: the session runs only part of the tests
        terminal.write_line(plan.line())
    resumed = config.stash[SESSION].resume(config, plan)
    if resumed is not None:
        config.stash[RESUMED] = resumed


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Record the run's end in run.json (the controller, or the only process) and print the one
    line of a worker's usage error. Rows the disk refused make the run incomplete and the exit
    non-zero; an xdist worker hands its count to the controller."""
    config = session.config
    if SESSION not in config.stash:
        return
    writer = config.stash.get(WRITER, None)
    if _is_worker(config):
        if writer is not None and writer.unwritten:
            config.workeroutput[WORKER_UNWRITTEN] = [writer.unwritten, writer.write_error, sorted(writer.unwritten_tests)]  # type: ignore[attr-defined]  # pytest-xdist sets it on a worker's config
        return
    watch = config.stash.get(SIGNALS, None)
    try:
        errors = config.stash.get(USAGE_ERRORS, [])
        for message in errors:
            print(f"ERROR: {message}", file=sys.stderr)
        if errors:
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
        if session.exitstatus == pytest.ExitCode.USAGE_ERROR and RESUMED in config.stash:
            config.stash[SESSION].restore(config.stash[RESUMED])  # refused before any test: the run is as it was
            return
        received = watch.received if watch is not None else None
        broken = _finish_ranks(session, signalled=received is not None)
        unwritten = _unwritten(config)
        if unwritten["count"] and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a row lost is never a clean exit
        stopped = broken or str(session.shouldfail or session.shouldstop or "")
        try:
            _record_suite_seconds(config)
            finish_run(
                config.stash[SESSION].run_dir,
                session.exitstatus,
                signal_name=received,
                stopped=stopped,
                unwritten=unwritten["count"],
                write_error=unwritten["error"],
                unwritten_tests=unwritten["tests"],
            )
        except OSError as exc:  # the disk that refused rows may refuse run.json too: say so, in one line
            print(f"parity: could not record the run's end in {RUN_INFO_FILE} ({exc}): it still says running", file=sys.stderr)
    finally:
        if watch is not None and config.stash.get(OWN_SIGNALS, True):
            watch.restore()


def _finish_ranks(session: pytest.Session, *, signalled: bool) -> str:
    """A tensor-parallel session's end (parity.plugin.ranks). A peer hands rank 0 its end and its
    verdicts and, once rank 0 has them, exits 0: rank 0 holds the run and its verdict. Rank 0 waits
    for every peer (or for the heartbeat to say one never will), says in one line each a rank that
    did not finish its tests or judged a gate row otherwise, and records them in run.json. Returns
    why the run is not complete ('' when every rank finished its tests)."""
    config = session.config
    group = config.stash.get(ranks.GROUP, None)
    if group is None or SESSION not in config.stash:
        return ""
    run_dir = config.stash[SESSION].run_dir
    if group.rank != 0:
        stopped = str(session.shouldfail or session.shouldstop or "")
        if group.finish_peer(int(session.exitstatus), stopped or (group.dead or ""), run_dir):
            session.exitstatus = pytest.ExitCode.OK
        return ""
    end = group.finish_rank0(run_dir, signalled=signalled, refused=session.exitstatus == pytest.ExitCode.USAGE_ERROR)
    for line in end.unfinished + end.disagreements:
        print(f"parity: {line}", file=sys.stderr)
    if (run_dir / RUN_INFO_FILE).is_file():
        update_run_info(
            run_dir,
            ranks={
                "world_size": group.world_size,
                "peers": {str(rank): {k: v for k, v in status.items() if k != "verdicts"} for rank, status in end.peers.items()},
                "unfinished": end.unfinished or None,
            },
            rank_disagreements=end.disagreements or None,
        )
    if end.disagreements and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not end.unfinished and group.dead is None:
        return ""
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.INTERRUPTED
    return "tensor-parallel group broken: " + "; ".join(end.unfinished or [str(group.dead)])


def _unwritten(config: pytest.Config) -> dict[str, Any]:
    """Rows this process and its xdist workers could not write: count, first error, their tests."""
    unwritten = dict(config.stash.get(UNWRITTEN, {"count": 0, "error": "", "tests": set()}))
    writer = config.stash.get(WRITER, None)
    if writer is not None and writer.unwritten:
        unwritten["count"] += writer.unwritten
        unwritten["error"] = unwritten["error"] or writer.write_error
        unwritten["tests"] = set(unwritten["tests"]) | set(writer.unwritten_tests)
    return unwritten


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    """A tensor-parallel rank's progress, for its heartbeat (parity.plugin.rank_health)."""
    if ranks.ACTIVE is not None:
        ranks.ACTIVE.moved(f"{nodeid} (setup)")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if ranks.ACTIVE is not None:
        after = {"setup": "call", "call": "teardown", "teardown": "done"}[report.when]
        ranks.ACTIVE.moved(f"{report.nodeid} ({after})")


def pytest_runtest_setup(item: pytest.Item) -> None:
    suite = lanes.suite_of(item)
    if suite is not None and (SUITE_PROPERTY, suite) not in item.user_properties:
        item.user_properties.append((SUITE_PROPERTY, suite))
    if item.get_closest_marker(lanes.GPU) is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("gpu test: no CUDA device on this machine (torch.cuda.is_available() is False)")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """A malformed case file is one readable line (file, table, key), not a loader traceback."""
    collected = yield
    if collected.failed and collected.longrepr is not None:
        marker = f"{CaseFileError.__name__}: "
        lines = [line for line in str(collected.longrepr).splitlines() if marker in line]
        if lines:
            collected.longrepr = lines[-1].split(marker, 1)[1].strip()
    return collected


_PLUGIN_FILES = (__file__, report_fixture_module.__file__, contextlib.__file__)


def _suite_traceback(item: pytest.Item, frame: types.FrameType | None) -> types.TracebackType | None:
    """A traceback from the test function down to the suite code in `frame` (the check that is
    recording a row), without the plugin's own frames; None when no frame of the suite is found.
    Built while the frames still run, so each entry holds the line executing then."""
    frames = []
    test_code = getattr(getattr(item, "function", None), "__code__", None)
    while frame is not None:
        if frame.f_code.co_filename not in _PLUGIN_FILES:
            frames.append(frame)
        if frame.f_code is test_code:
            break
        frame = frame.f_back
    else:  # recorded outside the test function (a fixture): the recording frame alone
        frames = frames[:1]
    tb = None
    for frame in frames:  # innermost first: each entry's next is the one it called
        tb = types.TracebackType(tb, frame, frame.f_lasti, frame.f_lineno)
    return tb


def _remember_where_rows_fail(item: pytest.Item, rep: SuiteReport) -> None:
    """Note, for the test's first failing gate row, where the suite recorded it (and the exception
    being handled then: a target's, caught by `report.guard`), so the failure pytest prints at the
    end of the test points at the suite's check and the target's frame, not at this plugin."""
    record = rep.record

    def record_noting_where(**fields: Any) -> dict[str, Any]:
        row = record(**fields)
        if row["kind"] == "gate" and row["verdict"] in (FAIL, ERROR) and _FAILED_AT not in vars(rep):
            vars(rep)[_FAILED_AT] = (_suite_traceback(item, sys._getframe(1)), sys.exc_info()[1])
        return row

    rep.record = record_noting_where  # type: ignore[method-assign]  # this test's report only


_FAILED_AT = "_parity_failed_at"  # SuiteReport attribute: (traceback, exception handled) of its first failing row


def _forget_where_rows_fail(rep: SuiteReport | None) -> tuple[types.TracebackType | None, BaseException | None]:
    """Put the report's own `record` back; the traceback and exception noted for its first failing
    row (None, None when none failed)."""
    if rep is None:
        return None, None
    vars(rep).pop("record", None)
    return vars(rep).pop(_FAILED_AT, (None, None))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Every failure reaches the CSV: a raised check becomes an `error` row, a bare assert a `fail`
    row, and a recorded failing row fails a test that would otherwise have passed. The failure shows
    the suite's frames (the test function down to the check that recorded the first failing row)
    and the target's when it raised; this wrapper's frame is hidden (`__tracebackhide__`)."""
    __tracebackhide__ = True
    rep = item.stash.get(REPORT, None)
    if rep is not None:
        _remember_where_rows_fail(item, rep)
    try:
        result = yield
    except BaseException as exc:
        _forget_where_rows_fail(rep)
        # An interruption, a deliberate pytest.exit or a row the disk refused is no error of the check.
        quiet = (pytest.skip.Exception, pytest.exit.Exception, KeyboardInterrupt, RowNotWritten)
        if rep is not None and not rep.failures and not isinstance(exc, quiet):
            is_assert = isinstance(exc, AssertionError)
            message = f"{type(exc).__name__}: {exc}".strip().replace("\n", " | ")[:2000] if is_assert else error_line(exc)
            rep.record(
                metric="assertion" if is_assert else "exception",
                value=None,
                verdict=FAIL if is_assert else ERROR,
                detail=message,
            )
        raise
    where, cause = _forget_where_rows_fail(rep)
    if rep is not None and rep.failures:
        raise AssertionError(rep.failure_text()).with_traceback(where) from cause
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A suite test whose setup failed (a model that would not load, a fixture that raised) still
    leaves an `error` row, so a run's CSV accounts for every test of a suite."""
    outcome = yield
    suite = lanes.suite_of(item)
    if call.excinfo is not None and isinstance(call.excinfo.value, RowNotWritten):
        outcome.longrepr = str(call.excinfo.value)  # one line: the file, the row and the disk's error
        return outcome
    group = item.config.stash.get(ranks.GROUP, None)
    if group is not None and call.excinfo is not None:
        group.collective_failed(item.session, item.nodeid, call.excinfo.value, call.excinfo.tb)
    with contextlib.suppress(RowNotWritten):  # counted by the writer: the session says so at its end
        if outcome.skipped and suite and outcome.when in ("setup", "call"):
            _write_skip_row(item, suite, outcome)
        if outcome.when == "call" and outcome.failed and REPORT in item.stash:  # its line, printed now (parity.plugin.live)
            live.attach(outcome, live.case_lines(item.stash[REPORT].rows, item.config.stash[SESSION].run_dir))
        if outcome.when == "setup" and outcome.failed and suite and call.excinfo is not None:
            exc = call.excinfo.value
            message = f"setup failed: {error_line(exc)}"
            row = item.config.stash[WRITER].write(
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
            live.attach(outcome, live.case_lines([row], item.config.stash[SESSION].run_dir))
    return outcome


def skip_reason(test_report: pytest.TestReport) -> str:
    """pytest's reason of a skipped test report (`longrepr` is (path, line, "Skipped: reason"))."""
    longrepr = test_report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr or "")
    return text.removeprefix("Skipped: ").strip() or "skipped (no reason given)"


def _write_skip_row(item: pytest.Item, suite: str, test_report: pytest.TestReport) -> None:
    """One `skip` row per skipped suite test, with pytest's reason, so results.csv accounts for every
    collected test and the review page can say why a check did not run."""
    if getattr(test_report, "wasxfail", None) is not None:
        return
    params = getattr(getattr(item, "callspec", None), "params", {})
    mode = params.get("mode") if isinstance(params.get("mode"), str) else None
    item.config.stash[WRITER].write(
        {
            "suite": suite,
            "case": default_case(item),
            "mode": mode,
            "metric": "skipped",
            "value": None,
            "verdict": SKIP,
            "detail": skip_reason(test_report).replace("\n", " | ")[:2000],
            "kind": "info",  # decided nothing: readers of gate rows see only judged checks
            "better": "",
            "test": item.nodeid,
        }
    )


class _SuiteClock:
    """Seconds per report suite: setup, call and teardown of its tests, summed. Registered on the
    controller, where every xdist worker's reports arrive (the suite travels as a user property);
    serially the sum is the suite's wall time, under xdist its test time across workers."""

    def __init__(self, config: pytest.Config) -> None:
        self.seconds = config.stash[SUITE_SECONDS] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        suite = dict(report.user_properties).get(SUITE_PROPERTY)
        if suite is not None:
            self.seconds[suite] = self.seconds.get(suite, 0.0) + float(report.duration)


def _record_suite_seconds(config: pytest.Config) -> None:
    """Write the seconds per suite into run.json (the controller; the run directory must exist)."""
    seconds = config.stash.get(SUITE_SECONDS, None)
    run = config.stash.get(SESSION, None)
    if not seconds or run is None or not (run.run_dir / RUN_INFO_FILE).exists():
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
    terminalreporter.write_line(format_summary(summarize(frame, config.stash.get(SUITE_SECONDS, None)), frame))
    failing = failing_cases_text(frame, session.run_dir)  # one line per failing case, each rule once
    if failing:
        terminalreporter.write_line(failing)
    terminalreporter.write_line(f"{len(frame)} rows in {session.run_dir / RESULTS_FILE}")
    unwritten = _unwritten(config)
    if unwritten["count"]:
        terminalreporter.write_line(
            f"parity: the run is incomplete: {unwritten_text(unwritten['count'], unwritten['error'])}; "
            "the summary above leaves them out"
        )

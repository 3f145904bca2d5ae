"""Interruptions and broken disks: every way a run can be cut short ends with one line,
the per-suite summary and a run.json that says what happened, and `--append` resumes.

* Signals (real `parity run` processes, the selfcheck suite held at a known point by
  tests/support/interrupt_plugin.py): SIGTERM, SIGHUP (a closed terminal) and a second Ctrl-C while the
  run's end is recorded. The broken variant (a repeated signal raising again, as before) loses the
  summary and the recorded status. SIGHUP's own row is in tests/harness/test_bad_inputs_targets.py.
* Rows the disk refuses (a file size limit on a real run; ENOSPC in an in-process session): the run
  is `incomplete`, the exit non-zero, and the summary says how many rows are missing.
* `--append` after an interruption runs only the tests whose rows are missing, drops the rows of
  the test that was stopped half-way, and the run reviews clean (`parity.plugin.resume`).
"""

from __future__ import annotations

import collections
import errno
import os
import resource
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from parity.cli import main
from parity.plugin import resume as resume_module
from parity.plugin.session import SignalWatch
from parity.report import RESULTS_FILE, ReportWriter, read_results, read_run_info, write_run_info
from tests.support.helpers import PROJECT_ROOT, default_signals, run_command, run_pytest_here, subprocess_env
from tests.support.interrupt_plugin import SignalledRun, signal_run

pytestmark = pytest.mark.parity_cpu

KEY = ["suite", "case", "target", "mode", "site", "metric"]


def ended_cleanly(result: SignalledRun, name: str) -> list[str]:
    """What a signalled `parity run` must show (empty when it does): a non-zero exit, no traceback,
    one line saying the run is interrupted by `name`, the summary, and run.json saying so too."""
    problems = []
    if result.code == 0:
        problems.append("exit 0")
    if "Traceback" in result.output or "INTERNALERROR" in result.output:
        problems.append("a traceback")
    said = [line for line in result.output.splitlines() if f"the run is interrupted ({name})" in line]
    if len(said) != 1:
        problems.append(f"{len(said)} line(s) saying the run is interrupted ({name})")
    if "parity summary" not in result.output or "selfcheck" not in result.output.split("parity summary")[-1]:
        problems.append("no per-suite summary")
    info = read_run_info(result.run_dir) if (result.run_dir / "run.json").is_file() else {}
    if (info.get("status"), info.get("signal")) != ("interrupted", name):
        problems.append(f"run.json says {info.get('status')} ({info.get('signal')})")
    return problems


@pytest.mark.parametrize("names", [("SIGTERM",), ("SIGINT", "SIGINT")], ids=["sigterm", "double-ctrl-c"])
@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_a_signal_ends_the_run_with_one_line_the_summary_and_its_status(names: tuple[str, ...], tmp_path: Path) -> None:
    result = signal_run(tmp_path, *names)
    assert ended_cleanly(result, names[0]) == [], result.output
    if len(names) > 1:
        assert "SIGINT again: already stopping after SIGINT" in result.output


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_without_the_guard_a_second_ctrl_c_loses_the_summary_and_the_status(tmp_path: Path) -> None:
    """The broken variant: every signal raises KeyboardInterrupt, the second one inside the end of
    the session (what a tester saw: a traceback, no summary, run.json left running)."""
    result = signal_run(tmp_path, "SIGINT", "SIGINT", broken="every-signal-raises")
    assert ended_cleanly(result, "SIGINT") != []


def test_the_watch_takes_int_term_and_hup_and_stops_once() -> None:
    """In this process, without sending a signal: the handler SignalWatch installs for each of the
    three raises KeyboardInterrupt the first time and only says so the second."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    if previous[signal.SIGINT] is not signal.default_int_handler or any(
        previous[s] is not signal.SIG_DFL for s in (signal.SIGTERM, signal.SIGHUP)
    ):
        pytest.skip(f"this process's signal handlers are not the defaults ({previous})")
    watch = SignalWatch("test").install()
    try:
        handlers = {name: signal.getsignal(getattr(signal, name)) for name in ("SIGINT", "SIGTERM", "SIGHUP")}
        assert all(handler == watch._handle for handler in handlers.values()), handlers
        assert SignalWatch.active() is watch
        with pytest.raises(KeyboardInterrupt, match="SIGHUP received"):
            watch._handle(signal.SIGHUP, None)
        watch._handle(signal.SIGINT, None)  # a repeat: no KeyboardInterrupt
        assert (watch.received, watch.repeats) == ("SIGHUP", 1)
    finally:
        watch.restore()
    assert {s: signal.getsignal(s) for s in previous} == previous and SignalWatch.active() is None


def test_without_sighup_in_the_watch_a_closed_terminal_is_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant of the check above: SIGHUP left to its default (the process dies and
    run.json stays `running`)."""
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL:
        pytest.skip("SIGHUP is not at its default in this process")
    monkeypatch.setattr(SignalWatch, "SIGNALS", ("SIGINT", "SIGTERM"))
    watch = SignalWatch("test").install()
    try:
        assert signal.getsignal(signal.SIGHUP) != watch._handle
    finally:
        watch.restore()


# ---------------------------------------------------------------------------------------------
# A disk that refuses rows
# ---------------------------------------------------------------------------------------------


def _file_size_limit() -> None:
    default_signals()
    resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))  # run.json fits, results.csv does not


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_a_file_size_limit_makes_a_real_run_incomplete_and_says_so(tmp_path: Path) -> None:
    run_dir = tmp_path / "reports" / "limited"
    command = ["-m", "parity", "run", "--suite", "selfcheck", "--report-dir", str(tmp_path / "reports"), "--run-id", "limited"]
    result = run_command([sys.executable, *command], cwd=PROJECT_ROOT, env=subprocess_env(), preexec_fn=_file_size_limit)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    info = read_run_info(run_dir)
    assert info["status"] == "incomplete" and info["unwritten_rows"] > 0, info
    said = [line for line in output.splitlines() if "the run is incomplete" in line]
    assert len(said) == 1 and "report row(s) could not be written" in said[0] and "File too large" in said[0], output
    assert "the summary below leaves those rows out" in said[0]
    assert "parity summary" in output and "Traceback" not in output


def refusing(keep: int, counter: list[int]) -> Any:
    original = ReportWriter.write_many

    def write_many(writer: ReportWriter, rows: Any) -> Any:
        counter[0] += 1
        if counter[0] > keep:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(writer, rows)

    return write_many


def selfcheck_args(tmp_path: Path, *extra: str) -> list[str]:
    reports = tmp_path / "reports"
    return [
        str(PROJECT_ROOT / "parity/suites/selfcheck"),
        "--parity-report-dir",
        str(reports),
        "--parity-run-id",
        "r",
        "-q",
        *extra,
    ]


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_rows_the_disk_refuses_make_the_run_incomplete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(ReportWriter, "write_many", refusing(6, [0]))
        code, output = run_pytest_here(selfcheck_args(tmp_path), basetemp=tmp_path / "t")
    info = read_run_info(tmp_path / "reports" / "r")
    assert code != 0, output
    assert info["status"] == "incomplete" and info["unwritten_rows"] >= 10, info
    assert "No space left on device" in info["reason"] and info["unwritten_tests"], info
    assert "Traceback" not in output


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_without_counting_refused_rows_the_run_says_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: a writer that lets the disk's error through uncounted (as before issue
    31) leaves run.json `complete` while rows are missing."""
    with monkeypatch.context() as patch:
        patch.setattr(ReportWriter, "write_many", refusing(6, [0]))
        patch.setattr(ReportWriter, "write", lambda self, row: self.write_many([row])[0])
        run_pytest_here(selfcheck_args(tmp_path), basetemp=tmp_path / "t")
    assert read_run_info(tmp_path / "reports" / "r")["status"] == "complete"


# ---------------------------------------------------------------------------------------------
# --append resumes
# ---------------------------------------------------------------------------------------------


class StopAfterRows:
    """Ends the session (`pytest.exit`, exit status 2, as an interruption) when the row after the
    first `rows` is about to be written: in the middle of a test that writes several."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def pytest_configure(self, config: pytest.Config) -> None:
        original, state = ReportWriter.write_many, {"n": 0}

        def write_many(writer: ReportWriter, rows: Any) -> Any:
            if state["n"] >= self.rows:
                pytest.exit("stopped half-way through a test", returncode=2)
            state["n"] += 1
            return original(writer, rows)

        self.patch = pytest.MonkeyPatch()
        self.patch.setattr(ReportWriter, "write_many", write_many)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.patch.undo()


def _session(tmp_path: Path, *extra: str, plugin: Any = None) -> tuple[int, str]:
    """A selfcheck session in this process; the same arguments each time (but `extra`), as a resumed
    session must be started, and the same base temporary directory."""
    import contextlib
    import io

    from tests.support.helpers import _in_process_args, _outside_this_session

    out = io.StringIO()
    args = [*_in_process_args(), f"--basetemp={tmp_path / 't'}", *selfcheck_args(tmp_path, *extra)]
    with _outside_this_session(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = pytest.main(args, plugins=[plugin] if plugin is not None else [])
    return int(code), out.getvalue()


@pytest.fixture(scope="module")
def complete_rows(tmp_path_factory: pytest.TempPathFactory) -> collections.Counter:
    """Rows per test of an uninterrupted selfcheck session: what a resumed run must end with."""
    tmp_path = tmp_path_factory.mktemp("complete")
    code, output = _session(tmp_path)
    assert code == 0, output
    return collections.Counter(read_results(tmp_path / "reports" / "r")["test"])


def interrupted_then_resumed(tmp_path: Path, stop_after: int) -> tuple[Path, dict[str, Any], str]:
    run_dir = tmp_path / "reports" / "r"
    code, output = _session(tmp_path, plugin=StopAfterRows(stop_after))
    assert code == 2 and read_run_info(run_dir)["status"] == "interrupted", output
    before = read_results(run_dir)
    code, output = _session(tmp_path, "--parity-append")
    return run_dir, {"before": before, "code": code}, output


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_append_after_an_interruption_runs_only_what_is_missing(
    tmp_path: Path, complete_rows: collections.Counter, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after 17 rows: 15 tests whole, the 16th (5 rows) with 2. The appended session runs
    the 16th alone, its 2 rows dropped first; the run ends with exactly the rows of an
    uninterrupted one, run.json complete, and `parity review` exits 0."""
    [last] = [test for test, count in complete_rows.items() if count > 1]
    run_dir, seen, output = interrupted_then_resumed(tmp_path, 17)
    before = seen["before"]
    assert seen["code"] == 0, output
    assert collections.Counter(before["test"])[last] == 2, before["test"].value_counts()
    assert "parity: resuming r: 15 test(s) already hold their rows" in output and "2 of their row(s) dropped" in output
    rows = read_results(run_dir)
    assert collections.Counter(rows["test"]) == complete_rows
    assert not rows.duplicated(KEY).any()
    rerun = set(rows.loc[~rows["time"].isin(before["time"]), "test"])
    assert rerun == {last}
    info = read_run_info(run_dir)
    assert info["status"] == "complete" and info["previous_sessions"][-1]["resumed"] is True
    assert info["previous_sessions"][-1]["rerun_by_next_session"] == [last]
    monkeypatch.chdir(tmp_path)
    assert main(["review", str(run_dir), "--no-baseline"]) == 0, capsys.readouterr().out


def _every_test_with_a_row_done(run_dir: Path) -> resume_module.ResumePlan:
    return resume_module.ResumePlan(run_dir, frozenset(read_results(run_dir)["test"]), frozenset(), 0, 0)


@pytest.mark.parametrize(
    "switch_off",
    [
        pytest.param(("_deselect_resumed", lambda config, items: None), id="reruns-all"),
        pytest.param(("drop_rows", lambda plan: None), id="keeps-half-rows"),
        pytest.param(("plan_resume", _every_test_with_a_row_done), id="trusts-half-tests"),
    ],
)
@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_without_each_rule_the_resumed_run_is_wrong(
    switch_off: tuple[str, Any], tmp_path: Path, complete_rows: collections.Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broken variants: rerun everything (duplicate rows), keep the half-written test's rows
    (its first rows twice), or count a test with any row as done (its missing rows never come)."""
    monkeypatch.setattr(f"parity.plugin.hooks.{switch_off[0]}", switch_off[1])
    run_dir, _, _ = interrupted_then_resumed(tmp_path, 17)
    rows = read_results(run_dir)
    assert rows.duplicated(KEY).any() or collections.Counter(rows["test"]) != complete_rows


def test_a_test_whose_row_the_disk_refused_runs_again(tmp_path: Path) -> None:
    """run.json's `unwritten_tests` (a row refused in the middle of a test that is not the last one)."""
    run_dir = tmp_path / "run"
    context = {"run_id": "run", "target": "serving", "device": "cpu", "dtype": "fp32", "size": "tiny", "worker": "main"}
    info = {"status": "incomplete", "unwritten_rows": 1, "unwritten_tests": ["t::a"]}
    writer = ReportWriter(run_dir, context, on_create=lambda d: write_run_info(d, info))
    for test in ("t::a", "t::b", "t::c"):
        writer.write({"suite": "selfcheck", "case": test, "metric": "m", "value": 1.0, "verdict": "pass", "test": test})
    plan = resume_module.plan_resume(run_dir)
    assert (plan.done, plan.rerun, plan.dropped_rows) == ({"t::b"}, {"t::a", "t::c"}, 2)
    resume_module.drop_rows(plan)
    assert list(read_results(run_dir)["test"]) == ["t::b"]
    (run_dir / RESULTS_FILE).write_text((run_dir / RESULTS_FILE).read_text() + "r,selfcheck,cut")  # torn
    plan = resume_module.plan_resume(run_dir)
    assert plan.torn == 1 and plan.changes_results


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_an_interruption_pytest_cannot_format_still_ends_with_the_summary(pytester: pytest.Pytester) -> None:
    """pytest's formatting of the interrupted traceback raising TypeError (Python 3.11, a frame
    without a line number) must not replace the run's end with pytest's own traceback."""
    pytester.makeconftest(
        """
import _pytest._code

def _cannot_format(self, *args, **kwargs):
    raise TypeError("unsupported operand type(s) for -: 'NoneType' and 'int'")

_pytest._code.ExceptionInfo.getrepr = _cannot_format
"""
    )
    pytester.makepyfile(
        """
import pytest

@pytest.mark.parity_suite("selfcheck")
def test_interrupted():
    raise KeyboardInterrupt
"""
    )
    result = pytester.runpytest_subprocess("--parity-report-dir", str(pytester.path / "reports"))
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.INTERRUPTED, output
    assert "TypeError" not in output and "Traceback" not in output, output

"""Resuming a run with `--parity-append` (`parity run --append`): which tests run again.

A test is identified by its pytest node id, the `test` column of its rows. An appended session
runs a selected test again unless the run already **holds its rows**, which means both:

* `results.csv` has at least one whole row whose `test` is the test's node id (a torn record, cut
  short by a crash or a full disk, is no row), and
* the test is not one an earlier session may have left half-written: when the run's status is not
  `complete` (interrupted, crashed, still `running` with a dead process, `incomplete`), the last
  test that wrote rows in each process (each value of the `worker` column: `main`, `gw0`, ...) may
  have been stopped between two of its rows, and a test whose row the disk refused
  (`unwritten_tests` in `run.json`) is missing that row.

The rows of those half-written tests, and every torn record, are dropped from `results.csv` (a
rewrite through a temporary file and a rename, once the session is past its up-front checks and
before its first test), so no test's rows are ever recorded twice and the resumed run can review
clean. A test that wrote no row at all (nothing to duplicate) simply runs again. The node ids are
pytest's and depend on how it was started (`parity run` names the suites the same way each time):
start the appended session the way the run was started.

An appended session started with the same arguments as the session it follows (`--append` and the
number of xdist workers aside: `same_selection`) resumes it: it selects the same tests, so once it
completes, every test of the earlier session holds its rows, and the review counts the earlier
session as completed by it (`resumed` in run.json's `previous_sessions`). Started with other
arguments (other suites), it only adds rows, and an earlier session that did not complete still
makes the run incomplete.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import Any

from parity.report import COMPLETE, RESULTS_FILE, read_run_info
from parity.report.rundir import atomic_write


@dataclasses.dataclass(frozen=True)
class Record:
    """One record of results.csv as it stands in the file: its text, its test and whether it is whole."""

    text: str
    test: str
    worker: str
    whole: bool


def _records(path: Path) -> tuple[str, list[Record]]:
    """The header line and every record of `path`, torn ones included (as `check_results` reads them)."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    lines = text.splitlines(keepends=True)
    if not lines:
        return "", []
    reader = csv.reader(lines)
    header = next(reader)
    test, worker = (header.index(name) if name in header else None for name in ("test", "worker"))
    records, start = [], reader.line_num
    for fields in reader:
        end = reader.line_num
        whole = len(fields) == len(header) and lines[end - 1].endswith(("\n", "\r"))
        records.append(
            Record(
                "".join(lines[start:end]),
                fields[test] if whole and test is not None else "",
                fields[worker] if whole and worker is not None else "",
                whole,
            )
        )
        start = end
    return lines[0], records


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What an appended session does with the run it resumes (see the module docstring)."""

    run_dir: Path
    done: frozenset[str]  # node ids whose rows the run holds: not run again
    rerun: frozenset[str]  # node ids that may be half-written: their rows are dropped, they run again
    dropped_rows: int  # rows of `rerun` tests
    torn: int  # torn records, dropped too

    @property
    def changes_results(self) -> bool:
        return bool(self.dropped_rows or self.torn)

    def line(self) -> str:
        """The line the session prints as it starts (under -q too) about the resumed run."""
        text = f"parity: resuming {self.run_dir.name}: {len(self.done)} test(s) already hold their rows and do not run again"
        if self.rerun:
            text += (
                f"; {len(self.rerun)} may have been stopped half-way and run again ({self.dropped_rows} of their row(s) dropped)"
            )
        if self.torn:
            text += f"; {self.torn} torn record(s) dropped"
        return text


def plan_resume(run_dir: Path) -> ResumePlan:
    """Read the run in `run_dir` and decide which tests an appended session skips and reruns."""
    info = read_run_info(run_dir)
    _, records = _records(run_dir / RESULTS_FILE)
    whole = [r for r in records if r.whole and r.test]
    rerun: set[str] = set()
    if info.get("status") != COMPLETE:
        last: dict[str, str] = {}
        for record in whole:  # file order is write order within one process
            last[record.worker] = record.test
        rerun |= set(last.values())
        rerun |= {str(t) for t in info.get("unwritten_tests", []) if t}
    with_rows = {r.test for r in whole}
    dropped = sum(1 for r in whole if r.test in rerun)
    return ResumePlan(
        Path(run_dir), frozenset(with_rows - rerun), frozenset(rerun & with_rows), dropped, sum(not r.whole for r in records)
    )


def drop_rows(plan: ResumePlan) -> None:
    """Remove the rows of `plan.rerun` and every torn record from results.csv, written whole or not
    at all (`atomic_write`: a new file renamed over the old one, never through a link)."""
    if not plan.changes_results:
        return
    header, records = _records(plan.run_dir / RESULTS_FILE)
    kept = [r.text for r in records if r.whole and r.test not in plan.rerun]
    atomic_write(plan.run_dir / RESULTS_FILE, "".join([header if header.endswith(("\n", "\r")) else header + "\n", *kept]))


def _selection(args: list[str]) -> list[str]:
    """A session's arguments without those that do not change which tests it selects."""
    kept, skip = [], False
    for arg in map(str, args):
        if skip:
            skip = False
        elif arg in ("-n", "--numprocesses", "--dist"):
            skip = True
        elif arg.startswith(("-n", "--numprocesses=", "--dist=")) or arg in ("--parity-append", "--parity-overwrite"):
            continue
        else:
            kept.append(arg)
    return kept


def same_selection(earlier: Any, args: list[str]) -> bool:
    """Whether a session started with `args` selects the tests of an earlier one started with `earlier`."""
    return isinstance(earlier, list) and _selection(earlier) == _selection(args)

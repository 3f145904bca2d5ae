"""A run directory's files read once: its rows (as written and as a frame), run.json and its owner.

`RunFiles.read(run_dir)` is the one place a review reads a run; the audit, the summary, the
mutation scores, the comparison with a baseline, the page and `parity merge`'s checks are
functions of what it read. `parity run` reads its run once after pytest and hands the same object
to the summary, the scores and the review (docs/reports.md §5).

A run that did not complete says so here (`completeness`): run.json's status other than
`complete` (interrupted with its signal, crashed, still running or dead while running, none
recorded), an earlier appended session that did not complete, or records of `results.csv` cut short.
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

import pandas as pd

from parity.report.rows import Records, read_records
from parity.report.run_info import read_run_info
from parity.report.rundir import Owner, owner_alive, process_alive, read_owner, refuse_link
from parity.report.schema import COMPLETE, RESULTS_FILE, RUN_INFO_FILE, RUNNING


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """What a run directory held when it was read."""

    run_dir: Path
    records: Records  # results.csv as written, and (`frame`) as rows
    info: dict[str, Any]  # run.json ({} without one)
    has_info: bool  # whether run.json exists
    claim: bool | None  # whether a live process held the run's claim (None: no claim file, or the run is not running)
    owner: Owner | None  # the claim's record, read when the claim was free

    @classmethod
    def read(cls, run_dir: str | Path) -> RunFiles:
        """Read `run_dir` (refusing a symbolic link, for the directory and for results.csv:
        docs/reports.md §3); `FileNotFoundError` when it is not a run directory."""
        run_dir = Path(run_dir)
        refuse_link(run_dir, "the run directory")
        if not run_dir.is_dir():
            raise FileNotFoundError(f"{run_dir} is not a run directory (a directory holding {RESULTS_FILE})")
        refuse_link(run_dir / RESULTS_FILE, RESULTS_FILE)
        records = read_records(run_dir / RESULTS_FILE)
        info = read_run_info(run_dir)
        claim = owner_alive(run_dir) if info.get("status") == RUNNING else None
        owner = read_owner(run_dir) if claim is False else None
        return cls(run_dir, records, info, (run_dir / RUN_INFO_FILE).is_file(), claim, owner)

    @property
    def frame(self) -> pd.DataFrame:
        """The run's whole rows (value/threshold as floats)."""
        return self.records.frame


_process_alive = process_alive  # the run.json check, where no claim file says more


def status_problem(info: dict[str, Any], what: str = "the run", claim: bool | None = None) -> str | None:
    """One line saying why `info` (a run.json, or one of its earlier sessions) is not a complete
    run, or None when it is. `claim`: whether the run directory's owner still holds its claim
    (`parity.report.rundir.owner_alive`; None: no claim file), which outranks the process id."""
    status = info.get("status")
    if status == COMPLETE:
        return None
    if status is None:
        return f"{RUN_INFO_FILE} records no status: whether {what} completed is unknown"
    if status == RUNNING:
        alive = _process_alive(info.get("pid"), info.get("host")) if claim is None else claim
        where = f"process {info.get('pid')} on {info.get('host')}"
        if alive:
            return f"{what} is still running ({where})"
        if alive is False:
            return (
                f"{what} says running but {where} is gone: it ended without recording its end (killed, or the machine went down)"
            )
        return f"{what} says running ({where}: cannot be checked from here whether it still runs)"
    how = info.get("signal") or info.get("reason") or "no reason recorded"
    return f"{what} was {status} ({how})"


def claimed_elsewhere(owner: Owner | None, info: dict[str, Any]) -> bool:
    """Whether a free lock here says nothing of the run's process: its owner record or its
    run.json names another host (a copied run directory, an owner file copied along with it), and
    a process there cannot be checked from here (docs/reports.md §2)."""
    here = socket.gethostname()
    return (owner is not None and owner.host != here) or info.get("host") not in (None, here)


def completeness(run: RunFiles) -> list[str]:
    """Every reason the run is not whole: its status, its earlier (appended) sessions, a missing
    run.json, torn records of results.csv. Empty: complete."""
    problems = []
    info = run.info
    if not run.has_info:
        problems.append(f"no {RUN_INFO_FILE}: whether the run completed is unknown")
    else:
        claim = run.claim
        if claim is False and claimed_elsewhere(run.owner, info):
            claim = None
        problems += filter(None, [status_problem(info, claim=claim)])
        for n, earlier in enumerate(info.get("previous_sessions", []), start=1):
            if earlier.get("resumed"):  # the next session, started the same way, ran its missing tests (parity.plugin.resume)
                continue
            problems += filter(None, [status_problem(earlier, f"earlier session {n} of this run (appended to)")])
    problems += run.records.check.problems()
    return problems

"""The bad-input table's machinery: what a row observes, how it runs, what every row must show.

A row (`Bad`) makes one mistake a user under pressure makes and names the words the one line that
explains it must hold. `tests/harness/test_bad_inputs.py` holds the table of the classic mistakes (case
files, checkpoints, options, runs under review, targets); other modules add tables of their own
(`tests/test_bad_inputs_*.py`) and check each row with `check_bad_input`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from parity.cli import main


@dataclasses.dataclass
class Outcome:
    code: int  # the exit status; 1 for a raised error, 0 when nothing complained
    output: str  # everything the user would see
    skipped: str = ""  # the skip reason(s), for rows where skipping is the right answer
    preserved: bool | None = None  # whether an existing run's results.csv is unchanged (None: no run involved)


def raised(call: Callable[[], Any]) -> Outcome:
    """Call in-process; the error a user sees is the exception's type and message."""
    try:
        call()
    except pytest.skip.Exception as exc:
        return Outcome(0, "", skipped=str(exc.msg))
    except Exception as exc:
        return Outcome(1, f"{type(exc).__name__}: {exc}")
    return Outcome(0, "(no error)")


def cli(*args: str) -> Outcome:
    """`parity ...` in-process, its stdout and stderr captured (argparse exits through SystemExit)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return Outcome(int(code), out.getvalue() + err.getvalue())


def process(result: subprocess.CompletedProcess) -> Outcome:
    return Outcome(result.returncode, result.stdout + result.stderr)


@dataclasses.dataclass(frozen=True)
class Bad:
    id: str
    run: Callable[[Path], Outcome]
    expect: tuple[str, ...]
    skip: bool = False  # the right answer is a skip whose reason holds `expect`
    marks: tuple[Any, ...] = ()


def check_bad_input(row: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Outcome:
    """What every row of a bad-input table must show: a non-zero exit or a raised error (or a skip
    with its reason), exactly one line of output holding all of the row's words, no traceback, and
    an existing run's rows unchanged. Returns the outcome (for the table's own checks: its exit status)."""
    monkeypatch.chdir(tmp_path)  # a review writes its page, a run its reports: keep them here
    outcome = row.run(tmp_path)
    shown = f"exit {outcome.code}; output:\n{outcome.output}\nskipped: {outcome.skipped}"
    assert "Traceback" not in outcome.output and "INTERNALERROR" not in outcome.output, shown
    if outcome.preserved is not None:
        assert outcome.preserved, "a row already written was lost or changed\n" + shown
    if row.skip:
        reasons = [line for line in outcome.skipped.splitlines() if all(word in line for word in row.expect)]
        assert len(reasons) == 1, shown
        return outcome
    assert outcome.code != 0, shown
    explaining = [line for line in outcome.output.splitlines() if all(word in line for word in row.expect)]
    assert len(explaining) == 1, f"expected one line holding {row.expect}\n{shown}"
    assert "left a run directory" not in outcome.output, shown
    return outcome

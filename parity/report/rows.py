"""Report rows: one long-format CSV per run, appended row by row, and read back once.

Every check writes its numbers as it produces them, so a crash, a Ctrl-C or a failing assertion
never loses a finished row. Under pytest-xdist all workers append to the same `results.csv`; an
exclusive `fcntl.flock` around each append keeps rows whole and the header single, so `-n 2`,
`-n 4` and a serial run leave exactly the same rows.

A results or baseline file is read once (`read_rows`): its records as text, each with the line it
starts on (the audit judges what was written, not a parse of it), and its rows as a frame built
from the same records, with the records cut short (a write that stopped half-way) left out of both.
"""

from __future__ import annotations

import csv
import dataclasses
import errno
import fcntl
import functools
import gzip
import io
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from parity.compare import BOUND_KINDS, FIXED, VERDICTS
from parity.report.run_info import now_text
from parity.report.rundir import UnsafePathError, open_directory
from parity.report.schema import (
    BETTER,
    COLUMNS,
    KINDS,
    RESULTS_FILE,
    ReportError,
    data_text,
    family_of_test,
    row_data,
)


class RowNotWritten(RuntimeError):
    """A row the disk refused (ENOSPC, EFBIG under a file size limit, EIO): one line naming the file,
    the row and the error. The writer counts it (`ReportWriter.unwritten`)."""


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def _csv_text(value: Any) -> Any:
    """A cell as pandas' to_csv writes it in a row of its own: a float by its shortest repr, a
    numpy float by the shortest repr of its own precision (np.float32(0.1) as 0.1)."""
    if isinstance(value, np.floating):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


class ReportWriter:
    """Appends rows to `run_dir/results.csv`, filling the run's context columns."""

    def __init__(self, run_dir: str | Path, context: Mapping[str, Any], *, on_create: Callable[[Path], None] | None = None):
        """`on_create(run_dir)` runs once per run, by the process that writes the first row (under
        the file lock): where a run's `run.json` is written, so a session without rows leaves nothing."""
        unknown = set(context) - set(COLUMNS)
        if unknown:
            raise ReportError(f"unknown report context columns: {sorted(unknown)}")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / RESULTS_FILE
        self.context = dict(context)
        self.on_create = on_create

    def _open(self) -> io.TextIOWrapper:
        """`results.csv` opened for appending, created if missing, never through a symbolic link: the
        run directory and the file are both opened with `O_NOFOLLOW` (docs/reports.md §3)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            directory = open_directory(self.run_dir)
        except UnsafePathError as exc:
            raise ReportError(str(exc)) from None
        try:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(RESULTS_FILE, flags, 0o666, dir_fd=directory)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ReportError(
                    f"{self.path}: a symbolic link (to {os.readlink(self.path)}); parity does not write rows through links"
                ) from None
            raise
        finally:
            os.close(directory)
        return open(fd, "a", newline="")

    def normalise(self, row: Mapping[str, Any]) -> dict[str, Any]:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise ReportError(f"unknown report columns {sorted(unknown)}; known: {', '.join(COLUMNS)}")
        full = dict.fromkeys(COLUMNS, "")
        full.update(self.context)
        full.update({k: v for k, v in row.items() if v is not None})
        for required in ("suite", "case", "metric", "verdict"):
            if full[required] in ("", None):
                raise ReportError(f"report row needs {required!r}: {dict(row)}")
        if full["verdict"] not in VERDICTS:
            raise ReportError(f"verdict must be one of {VERDICTS}, got {full['verdict']!r}")
        full["kind"] = full["kind"] or "gate"
        if full["kind"] not in KINDS:
            raise ReportError(f"kind must be one of {KINDS}, got {full['kind']!r}")
        if full["better"] not in BETTER:
            raise ReportError(f"better must be one of {BETTER[:-1]}, got {full['better']!r}")
        if full["bound"] == "":
            threshold = full["threshold"]
            has_bound = threshold not in ("", None) and not (isinstance(threshold, float) and math.isnan(threshold))
            full["bound"] = FIXED if has_bound else ""
        if full["bound"] not in BOUND_KINDS:
            raise ReportError(f"bound must be one of {BOUND_KINDS[:-1]} (or empty without a threshold), got {full['bound']!r}")
        full["mode"] = full["mode"] or "eager"
        full["family"] = full["family"] or family_of_test(str(full["test"]))
        full["time"] = full["time"] or now_text()
        full["data"] = _data_cell(full["data"])
        return {k: _cell(v) for k, v in full.items()}

    # Rows that could not be written by this writer (a full disk, a file size limit): counted so the
    # session can record the run as incomplete and exit non-zero (docs/reports.md §4).
    unwritten: int = 0
    unwritten_tests: frozenset[str] = frozenset()
    write_error: str = ""

    def write(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """Append one row now (flushed before returning); returns the row as written. A row the
        disk refused is counted and raised as one `RowNotWritten` line (never a silent loss)."""
        try:
            return self.write_many([row])[0]
        except OSError as exc:
            self.unwritten += 1
            test = str(row.get("test") or "")
            if test:
                self.unwritten_tests = self.unwritten_tests | {test}
            why = f"{type(exc).__name__}: {exc}".replace("\n", " | ")
            self.write_error = self.write_error or why
            where = f"suite {row.get('suite')!r} case {row.get('case')!r} metric {row.get('metric')!r}"
            raise RowNotWritten(f"a report row could not be written to {self.path} ({where}): {why}") from None

    def write_many(self, rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        full = [self.normalise(row) for row in rows]
        if not full:
            return full
        # The csv module, not a DataFrame: the same text pandas' to_csv writes for these cells
        # (tests/report/test_report.py checks it) at about 1/100 of the cost per row, which a run of
        # thousands of rows written one at a time pays for every row.
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerows([_csv_text(row[column]) for column in COLUMNS] for row in full)
        with self._open() as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                header = handle.tell() == 0 and os.fstat(handle.fileno()).st_size == 0
                if header and self.on_create is not None:
                    self.on_create(self.run_dir)
                if header:
                    handle.write(",".join(COLUMNS) + "\n")
                handle.write(text.getvalue())
                handle.flush()
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
        return full


def _data_cell(value: Any) -> str:
    """A row's `data` as written: a payload (a mapping) as JSON, a cell already written kept when it
    is a JSON object (`schema.row_data`)."""
    if isinstance(value, Mapping):
        return data_text(value)
    if value in ("", None):
        return ""
    try:
        row_data(value)
    except ValueError as exc:
        raise ReportError(f"data must be a JSON object (docs/reports.md §4), got {value!r}: {exc}") from None
    return str(value)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ResultsCheck:
    """What a `results.csv` holds: its complete rows, and the records cut short (a write that
    stopped half-way: a full disk, a lost machine) that reading leaves out."""

    path: Path
    rows: int
    torn: tuple[int, ...] = ()  # 1-based line numbers where a cut record starts
    empty: bool = False  # not even a header

    @property
    def header_only(self) -> bool:
        return not self.empty and self.rows == 0

    def problems(self) -> list[str]:
        """One line per problem, naming the file."""
        if self.empty:
            return [f"{self.path}: empty (no header, no rows)"]
        found = []
        if self.torn:
            lines = ", ".join(str(n) for n in self.torn)
            found.append(f"{self.path}: {len(self.torn)} torn record(s) at line(s) {lines} (cut short; left out)")
        if self.rows == 0:
            found.append(f"{self.path}: a header and no complete row")
        return found


@dataclasses.dataclass(frozen=True)
class Records:
    """A results or baseline file read once: its header and whole records, as text, each with the
    line it starts on (1-based), and the lines where a record cut short starts (left out)."""

    path: Path
    header: list[str]
    whole: list[tuple[int, dict[str, str]]]
    torn: list[int]
    empty: bool = False  # not even a header

    @property
    def check(self) -> ResultsCheck:
        return ResultsCheck(self.path, len(self.whole), tuple(self.torn), empty=self.empty)

    @functools.cached_property
    def frame(self) -> pd.DataFrame:
        """The whole records as rows: every column text as written, value/threshold as floats (an
        empty cell is NaN). `ReportError` for a file without parity's columns."""
        return rows_frame(self)


def read_records(source: str | Path) -> Records:
    """Read a results or baseline CSV (a run directory means its results.csv; `.gz` is decompressed)
    once. A record with another number of fields than the header, or a last line without its
    newline, is cut short: listed in `torn`, never read as a row with empty cells."""
    path = Path(source)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no report rows at {path}")
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    if not raw.strip():
        return Records(path, [], [], [], empty=True)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReportError(f"{path}: not UTF-8 text (byte {exc.start}: {raw[exc.start : exc.start + 1]!r})") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, [])
        whole: list[tuple[int, dict[str, str]]] = []
        torn: list[int] = []
        start, last_whole = reader.line_num, False
        for record in reader:
            last_whole = len(record) == len(header)
            if last_whole:
                whole.append((start + 1, dict(zip(header, record, strict=True))))
            else:
                torn.append(start + 1)
            start = reader.line_num
    except csv.Error as exc:
        raise ReportError(f"{path}: not a readable CSV file (line {reader.line_num}: {exc})") from None
    if last_whole and not text.endswith(("\n", "\r")):  # the last record lost its newline: cut short
        torn.append(whole.pop()[0])
    return Records(path, header, whole, torn)


def rows_frame(records: Records, required: Iterable[str] = COLUMNS) -> pd.DataFrame:
    """`records` as a frame (see `Records.frame`); `required` names the columns the file must have
    (a baseline has no volatile columns)."""
    if records.empty:
        raise ReportError(f"{records.path}: empty (no header, no rows)")
    missing = [c for c in required if c not in records.header]
    if missing:
        raise ReportError(f"{records.path}: not a parity results file, missing columns {missing}")
    frame = pd.DataFrame([record for _, record in records.whole], columns=records.header, dtype=str)
    for column in ("value", "threshold"):
        frame[column] = pd.to_numeric(frame[column].replace("", "nan"), errors="coerce")
    return frame


def check_results(path: str | Path) -> ResultsCheck:
    """What a results file holds (`ResultsCheck`): its whole rows and its records cut short."""
    return read_records(path).check


def read_results(path: str | Path, required: Iterable[str] = COLUMNS) -> pd.DataFrame:
    """Load a run directory's `results.csv` (or a CSV path) with value/threshold as floats;
    `required` names the columns the file must have (a baseline drops the volatile ones). Records
    cut short (`check_results`) are left out, never read as rows with empty cells."""
    return rows_frame(read_records(path), required)

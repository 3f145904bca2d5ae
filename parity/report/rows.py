"""Report rows: one long-format CSV per run, appended row by row.

Every check writes its numbers as it produces them, so a crash, a Ctrl-C or a failing assertion
never loses a finished row. Under pytest-xdist all workers append to the same `results.csv`; an
exclusive `fcntl.flock` around each append keeps rows whole and the header single, so `-n 2`,
`-n 4` and a serial run leave exactly the same rows.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import errno
import fcntl
import io
import json
import math
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from parity.compare import BOUND_KINDS, ERROR, FAIL, FIXED, NOT_APPLICABLE, PASS, SKIP, TIE_FLIP, VERDICTS
from parity.report.rundir import UnsafePathError, atomic_write, open_directory, refuse_link

RESULTS_FILE = "results.csv"
RUN_INFO_FILE = "run.json"
# `run.json`'s `status`: written `running` with the first row, then the end of the session:
# `complete` (every selected test ran), `interrupted` (a signal, with its name, or pytest stopped
# early) or `crashed` (an internal error). A run that died without recording its end (SIGKILL, a
# lost machine) still says `running`, with a process id that no longer exists. `incomplete`: every
# selected test ran but some rows could not be written (a full disk; `unwritten_rows` says how many).
RUNNING, COMPLETE, INTERRUPTED, CRASHED, INCOMPLETE = "running", "complete", "interrupted", "crashed", "incomplete"
RUN_STATUSES = (RUNNING, COMPLETE, INTERRUPTED, CRASHED, INCOMPLETE)

# The columns of docs/reports.md §4: the run's context, `site` (where inside the model a number was
# taken: `layer.3`, `logits`, `block.layers.1`, `step.12`; empty for whole-output checks), the
# number and its bound, `kind` (gate = the row decided a verdict, info = a number recorded beside
# it), `better` (lower / higher / equal: the direction a baseline comparison reads the value in),
# `bound` (fixed = a policy, measured = derived from noise measured in the same run, '' = no
# bound), `test` (pytest node id), `worker` (xdist worker or "main"), `time` (UTC); `tp` is the
# run's tensor-parallel size (1: one process); `family`
# is the suites' family directory the row's test lives in (`ar`, `dit`, `routing`, `selfcheck`,
# `sensitivity`, ...: `family_of_test`), kept in baselines (unlike the node id, which depends on
# where pytest ran) so a review knows which rows a target that leaves a family out cannot have.
COLUMNS = (
    "run_id",
    "suite",
    "case",
    "target",
    "mode",
    "site",
    "device",
    "dtype",
    "size",
    "tp",
    "metric",
    "value",
    "threshold",
    "verdict",
    "detail",
    "seed",
    "torch_version",
    "git_sha",
    "kind",
    "better",
    "bound",
    "family",
    "test",
    "worker",
    "time",
)
KINDS = ("gate", "info")
BETTER = ("lower", "higher", "equal", "")

# Columns filled from the run's context rather than by each check.
CONTEXT_COLUMNS = ("run_id", "target", "device", "dtype", "size", "tp", "torch_version", "git_sha", "worker")


# `parity/suites/ar/test_numerics.py::...`, `suites/dit::image` (a family's not-provided row), an
# installed package's `site-packages/parity/suites/routing/...`: the directory after `suites/`.
_FAMILY_OF_TEST = re.compile(r"(?:^|/)suites/([A-Za-z0-9_]+)")


def family_of_test(test: str) -> str:
    """The suites' family directory a test node id lives in ('' for a test outside parity's suites)."""
    found = _FAMILY_OF_TEST.search(test)
    return found.group(1) if found else ""


def new_run_id() -> str:
    """A sortable, collision-safe run id: UTC timestamp plus 6 random hex digits."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def make_run_dir(report_dir: str | Path, run_id: str | None = None) -> Path:
    """Create `report_dir/run_id/` (a fresh id if none is given) and return it."""
    run_dir = Path(report_dir) / (run_id or new_run_id())
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def now_text() -> str:
    """The current UTC time as run.json and the rows write it."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


def write_run_info(run_dir: Path, info: Mapping[str, Any]) -> None:
    """Write `run.json` whole or not at all (a temporary file renamed over it): a crash while it is
    written leaves the previous version, never half a file."""
    refuse_link(Path(run_dir), "the run directory")
    atomic_write(Path(run_dir) / RUN_INFO_FILE, json.dumps(dict(info), indent=2, sort_keys=True, default=str) + "\n")


def add_suite_seconds(run_dir: Path, seconds: Mapping[str, float]) -> None:
    """Record in run.json the seconds each report suite's tests took (`suite_seconds`)."""
    info = read_run_info(run_dir)
    info["suite_seconds"] = {suite: round(value, 3) for suite, value in sorted(seconds.items())}
    write_run_info(run_dir, info)


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """`run.json` of a run directory ({} when there is none); an unreadable one is a ReportError."""
    path = Path(run_dir) / RUN_INFO_FILE
    if not path.exists():
        return {}
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(info, dict):
        raise ReportError(f"{path}: expected a JSON object, found {type(info).__name__}")
    return info


def update_run_info(run_dir: Path, **changes: Any) -> dict[str, Any]:
    """Change some keys of `run.json` (None removes a key) and write it back whole."""
    info = read_run_info(run_dir)
    for key, value in changes.items():
        if value is None:
            info.pop(key, None)
        else:
            info[key] = value
    write_run_info(run_dir, info)
    return info


class ReportError(ValueError):
    """A row that cannot be written as given (unknown column, bad verdict, bad kind)."""


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


@dataclasses.dataclass(frozen=True)
class ResultsCheck:
    """What a `results.csv` holds: its complete rows, and the records cut short (a write that
    stopped half-way: a full disk, a lost machine) that reading leaves out."""

    path: Path
    rows: int
    torn: tuple[int, ...] = ()  # 1-based line numbers where a cut record starts
    empty: bool = False  # not even a header
    spans: tuple[tuple[int, int], ...] = ()  # (first line, last line) of each torn record, 0-based

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


def check_results(path: str | Path) -> ResultsCheck:
    """Scan a plain `results.csv` for records cut short: a last line without its newline, or a
    record with another number of fields than the header. (Compressed files are not scanned.)"""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no report rows at {path}")
    raw = path.read_bytes()
    if not raw.strip():
        return ResultsCheck(path, 0, empty=True)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReportError(f"{path}: not UTF-8 text (byte {exc.start}: {raw[exc.start : exc.start + 1]!r})") from None
    lines = text.splitlines(keepends=True)
    reader = csv.reader(lines)
    header = next(reader)
    rows, torn, spans = 0, [], []
    start = reader.line_num
    for record in reader:
        end = reader.line_num
        cut = len(record) != len(header) or (end == len(lines) and not lines[-1].endswith(("\n", "\r")))
        if cut:
            torn.append(start + 1)
            spans.append((start, end - 1))
        else:
            rows += 1
        start = end
    return ResultsCheck(path, rows, tuple(torn), spans=tuple(spans))


def read_results(path: str | Path, required: Iterable[str] = COLUMNS) -> pd.DataFrame:
    """Load a run directory's `results.csv` (or a CSV path) with value/threshold as floats;
    `required` names the columns the file must have (a baseline drops the volatile ones). Records
    cut short (`check_results`) are left out, never read as rows with empty cells."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no report rows at {path}")
    source: Any = path
    if path.suffix == ".csv":
        check = check_results(path)
        if check.empty:
            raise ReportError(f"{path}: empty (no header, no rows)")
        if check.spans:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            drop = {n for first, last in check.spans for n in range(first, last + 1)}
            source = io.StringIO("".join(line for n, line in enumerate(lines) if n not in drop))
    try:
        frame = pd.read_csv(source, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: not a readable CSV file ({type(exc).__name__}: {str(exc).strip().splitlines()[0]})") from None
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise ReportError(f"{path}: not a parity results file, missing columns {missing}")
    for column in ("value", "threshold"):
        frame[column] = pd.to_numeric(frame[column].replace("", "nan"), errors="coerce")
    return frame


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------

# A case with a passing row and rows that do not apply passes; a case whose rows all do not apply is
# `not_applicable`; a case (test) that pytest skipped has one `skip` row and counts as `skip`.
SUMMARY_COLUMNS = ["suite", "cases", "pass", "fail", "tie_flip", "error", "not_applicable", "skip", "worst"]
_SEVERITY = {SKIP: -2, NOT_APPLICABLE: -1, PASS: 0, TIE_FLIP: 1, FAIL: 2, ERROR: 3}
CASE_KEYS = ["suite", "case", "target", "mode"]  # a case's verdict spans all its sites
# The metric of the one row per (suite, family) a run leaves out because the target does not provide
# the family (or the suite does not apply to it): `case` is the family, `value` the tests not run.
NOT_PROVIDED = "family_not_provided"


def case_verdicts(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (suite, case, target, mode): the worst verdict among its gate rows (a skipped
    test's `skip` row, an info row, counts for a case with no gate row)."""
    gates = frame[((frame["kind"] != "info") | (frame["verdict"] == SKIP)) & (frame["metric"] != NOT_PROVIDED)]
    if gates.empty:
        return pd.DataFrame(columns=CASE_KEYS + ["verdict"])
    worst = gates.assign(severity=gates["verdict"].map(_SEVERITY)).groupby(CASE_KEYS, sort=False)["severity"].max()
    names = {v: k for k, v in _SEVERITY.items()}
    return worst.map(names).rename("verdict").reset_index()


def _badness(row: Any) -> float:
    """How close a gate row came to its bound (1.0 = at the bound, > 1 = over it); `row` has the
    columns as attributes (a row of `DataFrame.itertuples`)."""
    value, threshold = row.value, row.threshold
    if row.verdict == ERROR:
        return math.inf
    if row.verdict in (NOT_APPLICABLE, SKIP) or pd.isna(value) or pd.isna(threshold):
        return -math.inf
    if row.better == "equal":
        return 0.0 if value == threshold else math.inf
    if row.better == "higher":
        return threshold / value if value not in (0, math.inf) else (0.0 if value == math.inf else math.inf)
    if threshold == 0:
        return 0.0 if value == 0 else math.inf
    return value / threshold


CAUSE_CHARS = 120  # an error's cause in the summary's worst column: the type, the place, the message's start


def error_cause(detail: str) -> str:
    """An error row's detail cut to its first line (`RuntimeError (at model.py:179 in moe): ...`)."""
    line = detail.split(" | ", 1)[0].strip()
    return line if len(line) <= CAUSE_CHARS else line[: CAUSE_CHARS - 3] + "..."


def summarize(frame: pd.DataFrame, seconds: Mapping[str, float] | None = None) -> pd.DataFrame:
    """Per suite: cases, pass, fail, tie_flip, error, not_applicable, skip and the gate row nearest
    to (or past) its bound; with `seconds` (run.json's `suite_seconds`) also the seconds its tests took."""
    verdicts = case_verdicts(frame)
    rows = []
    for suite, group in verdicts.groupby("suite", sort=True):
        counts = group["verdict"].value_counts()
        gates = frame[(frame["suite"] == suite) & (frame["kind"] != "info")]
        worst = ""
        if not gates.empty:
            scored = gates.assign(badness=[_badness(row) for row in gates.itertuples(index=False)])
            top = scored.sort_values("badness", ascending=False, kind="stable").iloc[0]
            if top["verdict"] == ERROR:  # no value to show: the error's one-line cause and where it was raised
                worst = f"{top['metric']}: {error_cause(str(top['detail']))} [{top['case']}/{top['mode']}]"
            elif top["badness"] != -math.inf:
                # The direction the value is held to: `block_compiles=2 (bound ≥ 1)` reads right, `(bound 1)` does not.
                relation = {"higher": "≥ ", "lower": "≤ ", "equal": "= "}.get(str(top.get("better", "")), "")
                bound = "" if pd.isna(top["threshold"]) else f" (bound {relation}{top['threshold']:.4g})"
                worst = f"{top['metric']}={top['value']:.4g}{bound} [{top['case']}/{top['mode']}]"
        rows.append(
            {
                "suite": suite,
                "cases": len(group),
                "pass": int(counts.get(PASS, 0)),
                "fail": int(counts.get(FAIL, 0)),
                "tie_flip": int(counts.get(TIE_FLIP, 0)),
                "error": int(counts.get(ERROR, 0)),
                "not_applicable": int(counts.get(NOT_APPLICABLE, 0)),
                "skip": int(counts.get(SKIP, 0)),
                "worst": worst,
            }
        )
    summary = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    if seconds:
        summary.insert(len(SUMMARY_COLUMNS) - 1, "seconds", [round(seconds.get(s, math.nan), 1) for s in summary["suite"]])
    return summary


@dataclasses.dataclass(frozen=True)
class MutationScore:
    """The sensitivity suite's verdict on the catalogue, on the lane the run used.

    `applicable` counts mutants that can show on this lane; a mutant that cannot (an equivalent
    mutant at this configuration) is `not_applicable` and counts neither as killed nor as a survivor.
    """

    killed: int
    applicable: int
    not_applicable: list[str]
    survivors: list[str]
    per_suite: dict[str, tuple[int, int]]  # suite -> (killed, applicable)
    device: str = "cpu"  # the run's device and tensor-parallel size: which of the catalogue's mutants it runs
    tp: int = 1
    # The planted catalogue's score (`PLANTED_SUITE` rows) names the target it was planted in.
    on: str = ""

    def line(self, catalogue: int | None = None) -> str:
        """The score in one line; with the catalogue's size (`catalogue`, else the catalogue this
        process has loaded), also how many mutants have no row: an interrupted or narrowed run
        scores only the mutants that ran, and must say so."""
        suites = ", ".join(f"{suite} {k}/{n}" for suite, (k, n) in sorted(self.per_suite.items()))
        if self.on:
            text = (
                f"mutation score on {self.on}: {self.killed}/{self.applicable} applicable target-level mutants killed ({suites})"
            )
        else:
            text = f"mutation score: {self.killed}/{self.applicable} applicable mutants killed on this lane ({suites})"
        if self.not_applicable:
            text += f"; not applicable here: {', '.join(self.not_applicable)}"
        if self.survivors:
            text += f"; SURVIVED: {', '.join(self.survivors)}"
        size = catalogue if catalogue is not None else _loaded_catalogue_size(self.device, self.tp, planted=bool(self.on))
        ran = self.applicable + len(self.not_applicable)
        if size is not None and ran < size:
            text += f"; {size - ran} of the catalogue's {size} mutants DID NOT RUN (an interrupted or narrowed run: the score covers {ran})"
        return text


def _loaded_planted_size() -> int | None:
    """The planted catalogue's size when this process has loaded it (every entry gets a row in any
    run that runs it: killed, survived or not applicable); looked up, never imported."""
    module = sys.modules.get("parity.suites.sensitivity.plant")
    return len(module.PLANTED) if module is not None and getattr(module, "PLANTED", None) else None


def _loaded_catalogue_size(device: str, tp: int, *, planted: bool = False) -> int | None:
    """How many of the mutant catalogue's mutants a run on `device` at tensor-parallel size `tp`
    runs (a sharding mutant runs only at its own size, every other one only in one process), when
    this process has loaded the catalogue (`parity run` has: its pytest collected the sensitivity
    suite), else None. Looked up, never imported: the report layer does not import the suites
    (tests/repo/test_layering.py)."""
    if planted:
        return _loaded_planted_size()
    catalogue = sys.modules.get("parity.suites.sensitivity.catalogue")
    if catalogue is None:
        return None
    try:
        lane = catalogue.lane_of(device)
        return sum(1 for mutant in catalogue.all_mutants().values() if catalogue.applies_at(mutant, lane, tp))
    except Exception:  # a catalogue that cannot load here says nothing about the run's rows
        return None


# The report suite of the planted catalogue (`parity.target.PLANTED_SUITE`; the report layer
# imports nothing of parity but compare).
PLANTED_SUITE = "target_mutants"


def mutation_score(frame: pd.DataFrame, *, planted_on: str | None = None) -> MutationScore | None:
    """The score from the sensitivity suite's `killed` rows (case = mutant, mode = the suite that
    must kill it), or None when the run has none. With `planted_on` (the target's name), the score
    of the planted catalogue's rows (`PLANTED_SUITE`) instead: mutants planted in that target."""
    suite = PLANTED_SUITE if planted_on is not None else "sensitivity"
    rows = frame[(frame["suite"] == suite) & (frame["metric"] == "killed")]
    if rows.empty:
        return None
    na = rows["verdict"] == NOT_APPLICABLE
    applicable = rows[~na]
    killed = applicable["verdict"] == PASS
    per_suite = {
        suite: (int((group["verdict"] == PASS).sum()), len(group)) for suite, group in applicable.groupby("mode", sort=True)
    }
    return MutationScore(
        killed=int(killed.sum()),
        applicable=len(applicable),
        not_applicable=rows.loc[na, "case"].tolist(),
        survivors=applicable.loc[~killed, "case"].tolist(),
        per_suite=per_suite,
        device=str(rows["device"].iloc[0]) if "device" in rows.columns else "cpu",
        tp=run_tp(rows),
        on=_planted_on(rows, planted_on),
    )


def _planted_on(rows: pd.DataFrame, name: str | None) -> str:
    """What a planted score names: the target's declared name, else its `--target` value."""
    if name is None:
        return ""
    return name or (str(rows["target"].iloc[0]) if "target" in rows.columns else "the target")


def run_tp(frame: pd.DataFrame) -> int:
    """The tensor-parallel size of a run's (or baseline's) rows; 1 where the column is empty (a
    single-process run's rows written without it)."""
    if "tp" not in frame.columns:
        return 1
    sizes = {int(float(v)) for v in frame["tp"] if str(v) not in ("", "nan")}
    return max(sizes) if sizes else 1


def format_summary(summary: pd.DataFrame, frame: pd.DataFrame | None = None) -> str:
    """The summary table; with the run's rows, a line per family (or suite) the target left out."""
    lines = [summary.to_string(index=False)] if not summary.empty else []
    lines += not_provided_lines(frame) if frame is not None else []
    return "\n".join(lines) or "(no report rows)"


def not_provided_lines(frame: pd.DataFrame) -> list[str]:
    """One line per family the run left out (its `NOT_PROVIDED` rows): the suites and tests not
    run and why, in place of a skip row per test."""
    rows = frame[frame["metric"] == NOT_PROVIDED]
    lines = []
    for (family, reason), group in rows.groupby(["case", "detail"], sort=False):
        tests = int(pd.to_numeric(group["value"], errors="coerce").fillna(0).sum())
        suites = ", ".join(dict.fromkeys(group["suite"]))
        lines.append(f"not run: {family} ({suites}: {tests} tests): {reason}")
    return lines


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """What a finished run says about itself: the summary and whether anything failed."""

    rows: int
    summary: pd.DataFrame
    failed_cases: int

    @property
    def ok(self) -> bool:
        return self.failed_cases == 0


def outcome(run_dir: str | Path) -> RunOutcome:
    frame = read_results(run_dir)
    summary = summarize(frame, read_run_info(Path(run_dir)).get("suite_seconds"))
    failed = int(summary["fail"].sum() + summary["error"].sum()) if not summary.empty else 0
    return RunOutcome(len(frame), summary, failed)

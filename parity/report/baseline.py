"""Baselines: committed expectations per device kind and dtype, read and written whole.

A baseline is a run's rows with the volatile columns (run id, time, worker, test, git sha) and the
`data` payloads removed and the rows sorted, kept at `reports/baselines/<device kind>-<dtype>.csv`
(`cpu-fp32.csv`, `h200-bf16.csv`), so a regenerated baseline diffs line by line in review. What a
run is judged against must be whole and sound: a baseline is read once, and refused with one line
when a record is cut short or the audit refuses a row (`load_rows(strict=True)`). The comparison
itself: `parity.report.comparison`.
"""

from __future__ import annotations

import csv
import gzip
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from parity.compare import ERROR, FAIL
from parity.report.audit import audit_records
from parity.report.quick import baseline_suffix
from parity.report.rows import read_records, rows_frame
from parity.report.run_info import read_run_info, target_name
from parity.report.rundir import UnsafePathError, atomic_write
from parity.report.schema import (
    BASELINE_COLUMNS,
    CASE_KEYS,
    COLUMNS,
    RESULTS_FILE,
    ROW_KEYS,
    RUN_INFO_FILE,
    VOLATILE_COLUMNS,
    ReportError,
)

BASELINE_DIR = Path("reports") / "baselines"  # relative to the directory a command runs in
# What a baseline is valid for: a run must agree on all of these to be compared with it.
CONFIG_COLUMNS = ("device", "dtype", "size", "target")
_FAILING = (FAIL, ERROR)


class BaselineError(ValueError):
    """A baseline that cannot be used for this run (missing, or made for another configuration)."""


def load_rows(source: str | Path, *, strict: bool = False) -> pd.DataFrame:
    """Rows of a run directory, a `results.csv` or a baseline CSV, read once, with value/threshold as floats.

    Columns a baseline does not carry (the volatile ones, `data`) come back as empty strings.
    `strict` (a baseline: what a run is judged against must be whole and sound) refuses, with one
    line naming the file and line, a record cut short, a value that is not a number, a verdict,
    kind, `better` or `bound` the writer does not write, and a row whose verdict its numbers
    contradict (parity.report.audit).
    """
    path = Path(source)
    try:
        records = read_records(path)
    except (ReportError, OSError, EOFError) as exc:  # EOFError: a .gz cut short
        if not strict or isinstance(exc, FileNotFoundError):
            raise
        raise BaselineError(f"baseline {path}: {exc}") from None
    if strict and not records.empty:
        if records.torn:
            raise BaselineError(
                f"baseline {records.path} line {records.torn[0]}: a record cut short ({len(records.torn)} in all); "
                "a baseline is never read in part: regenerate it"
            )
        if all(c in records.header for c in BASELINE_COLUMNS):  # else rows_frame says "not a parity results file"
            info = read_run_info(path) if path.is_dir() else {}
            problems = audit_records(records, info).problems
            if problems:
                more = f" ({len(problems)} problems in all)" if len(problems) > 1 else ""
                raise BaselineError(f"baseline {records.path.parent}/{problems[0].line()}{more}")
    frame = rows_frame(records, required=BASELINE_COLUMNS)
    for column in COLUMNS:
        if column not in frame.columns:
            frame[column] = ""
    return frame[list(COLUMNS)].copy()


def misplaced_family(rows: pd.DataFrame, suite_families: Mapping[str, Collection[str]], name: str) -> str | None:
    """The first baseline row whose `family` column its suite cannot have (`suite_families`: the
    family directories whose tests write each suite, `parity.target.suite_families`), as one line;
    None when every row's family fits. The family decides which rows a review leaves out for a
    target that does not provide it (`not_compared`), so a wrong one could hide a vanished case.
    Rows without a family (a baseline older than the column) and suites not in the map pass."""
    if "family" not in rows.columns:
        return None
    for position, (suite, family) in enumerate(zip(rows["suite"], rows["family"], strict=True)):
        allowed = suite_families.get(str(suite))
        if allowed is None or family in ("", None) or family in allowed:
            continue
        row = rows.iloc[position]
        return (
            f"baseline {name} line {position + 2} ({row_location(row)}): family {family!r}, but the {suite} suite's rows are "
            f"family {' or '.join(sorted(allowed))}: a row's family decides whether a review compares it; regenerate the baseline"
        )
    return None


def device_kind(device: str, device_name: str = "") -> str:
    """`cpu` for the CPU; the GPU's model as a short slug on CUDA (`NVIDIA H200` -> `h200`)."""
    if device != "cuda":
        return device or "unknown"
    name = re.sub(r"^nvidia\s+", "", device_name.strip(), flags=re.IGNORECASE)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "cuda"


def _single(frame: pd.DataFrame, column: str, where: str) -> str:
    values = sorted(set(frame[column]) - {""})
    if len(values) != 1:
        raise BaselineError(f"{where}: expected one {column} in the rows, found {values or 'none'}")
    return values[0]


def run_config(frame: pd.DataFrame, where: str) -> dict[str, str]:
    """The (device, dtype, size, target) every row of a run or baseline shares."""
    return {column: _single(frame, column, where) for column in CONFIG_COLUMNS}


def source_device_kind(source: str | Path, frame: pd.DataFrame) -> str | None:
    """The device kind a baseline was made on: from the rows when their device is the CPU, from a
    run directory's run.json, from a CSV in a `baselines/` directory named `<device kind>-<dtype>.csv`
    (the committed baselines' convention) whose rows have that dtype; None when it cannot be told."""
    source = Path(source)
    if frame.empty:
        return None
    config = run_config(frame, str(source))
    if config["device"] != "cuda":
        return device_kind(config["device"])
    if source.is_dir():
        name = str(read_run_info(source).get("device_name", ""))
        return device_kind("cuda", name) if name else None
    if source.parent.name != BASELINE_DIR.name:
        return None
    stem = source.name.removesuffix(".gz").removesuffix(".csv")
    # `<device kind>-<dtype>.csv`; any other target's `<device kind>-<dtype>-<target name or spec>.csv`
    kind, dtype, rest = stem.partition(f"-{config['dtype']}")
    named = rest == "" or (config["target"] != DEFAULT_TARGET and rest.startswith("-"))
    return kind if kind and dtype and named else None


# The built-in target's baselines keep their short names (`cpu-fp32.csv`); every other target's
# file carries the target's declared name in its name (docs/reports.md "Migrating"), so a porter's
# run never lands on the built-in one.
DEFAULT_TARGET = "serving"


def target_slug(target: str) -> str:
    """A file-name-safe form of a `--target` value: `my_engine.parity:make_target` -> `my_engine.parity-make_target`."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", target).strip("-.") or "target"


def default_baseline_path(
    run_dir: str | Path, frame: pd.DataFrame, baseline_dir: Path = BASELINE_DIR, *, info: Mapping[str, Any] | None = None
) -> Path:
    """`reports/baselines/<device kind>-<dtype>.csv` (of the working directory) for a run of the
    built-in target in `run_dir`; `<device kind>-<dtype>-<name>.csv` for any other target, keyed by
    the `name` the target declares (run.json: `info`, read from `run_dir` when not given), so
    renaming its adapter module keeps its baseline; a run that recorded no name is keyed by its
    `--target` value."""
    config = run_config(frame, str(run_dir))
    if info is None:
        info = read_run_info(Path(run_dir)) if Path(run_dir).is_dir() else {}
    key = target_name(info) or config["target"]
    return _baseline_path(config, info, key, baseline_dir)


def _baseline_path(config: dict[str, str], info: Mapping[str, Any], key: str, baseline_dir: Path) -> Path:
    kind = device_kind(config["device"], str(info.get("device_name", "")))
    suffix = ("" if config["target"] == DEFAULT_TARGET else f"-{target_slug(key)}") + baseline_suffix(config["size"])
    return Path(baseline_dir).absolute() / f"{kind}-{config['dtype']}{suffix}.csv"


def replacement_problem(old: pd.DataFrame, new: pd.DataFrame) -> str:
    """Why `new` must not replace the baseline `old` without `--force` ('' when it may): another
    configuration (target, device, dtype, size), or a less complete run (cases of the baseline's
    suites that the run lacks, a `--suite` run included)."""
    if old.empty:
        return ""
    old_config, new_config = run_config(old, "the existing baseline"), run_config(new, "this run")
    if old_config != new_config:
        return f"it was made for {config_text(old_config)}, this run is {config_text(new_config)}"
    old_cases = set(map(tuple, old[CASE_KEYS].drop_duplicates().to_numpy().tolist()))
    new_cases = set(map(tuple, new[CASE_KEYS].drop_duplicates().to_numpy().tolist()))
    lost = sorted(old_cases - new_cases)
    if lost:
        example = ", ".join("/".join(case) for case in lost[:3])
        return f"it holds {len(lost)} case(s) this run lacks (a more complete run), e.g. {example}"
    return ""


def baseline_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """A run's rows as a baseline: volatile columns dropped, rows in key order."""
    kept = frame[list(BASELINE_COLUMNS)].copy()
    kept["_n"] = kept.groupby(ROW_KEYS, sort=False).cumcount()
    kept = kept.sort_values(ROW_KEYS + ["_n"], kind="stable").drop(columns="_n")
    return kept.reset_index(drop=True)


def write_baseline(frame: pd.DataFrame, path: str | Path, *, force: bool = False) -> Path:
    """Write `frame` as a baseline, whole or not at all (a temporary file renamed over `path`: a
    write killed half-way leaves the old baseline); refuses a run with failing rows (a baseline is a
    clean state), a path `check_baseline_target` refuses, and, unless `force`, replacing an existing
    baseline of another configuration or target, one that holds cases the run lacks
    (`replacement_problem`) or one that cannot be read."""
    path = check_baseline_target(path)
    if path.exists() and path.stat().st_size > 0 and not force:
        try:
            old = load_rows(path, strict=True)
        except (BaselineError, ReportError) as exc:
            raise BaselineError(
                f"refusing to overwrite the baseline {path}: it is unreadable ({exc}); pass --force to replace it"
            ) from None
        problem = replacement_problem(old, frame)
        if problem:
            raise BaselineError(f"refusing to overwrite the baseline {path}: {problem}; pass --force to replace it")
    failing = frame[(frame["kind"] != "info") & frame["verdict"].isin(_FAILING)]
    if not failing.empty:
        first = failing.iloc[0]
        raise BaselineError(
            f"refusing to write a baseline from a run with {len(failing)} failing gate row(s), e.g. "
            f"{first['suite']}/{first['case']}/{first['mode']} {first['metric']}={first['value']} ({first['verdict']})"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = baseline_rows(frame)
    # Floats as Python's shortest round-trip repr: a regenerated baseline only diffs where a number did.
    for column in ("value", "threshold"):
        rows[column] = rows[column].map(_number_text)
    return atomic_write(path, rows.to_csv(index=False, lineterminator="\n"))


def check_baseline_target(path: str | Path) -> Path:
    """The path `--write-baseline` was given, if a baseline may be written there; else one line
    (`UnsafePathError`) saying why (docs/reports.md §2). A baseline is written exactly where it is
    named: never through a symbolic link, never into a directory that holds a run (its results.csv
    and run.json are the run's own: `parity review --write-baseline R/results.csv`, the option
    typed before the run directory, names the run's own file), and never over a file that is not a
    baseline (a results file, with the volatile columns, or any other file) -- `--force` replaces a
    baseline of another configuration, nothing else. An empty file may be replaced."""
    path = Path(path)
    hint = "put RUN_DIR before --write-baseline (after it, the next word is read as PATH)"
    if path.is_symlink():
        raise UnsafePathError(
            f"--write-baseline {path}: a symbolic link; a baseline is written where it is named: give the file it points to"
        )
    if path.is_dir():
        raise UnsafePathError(f"--write-baseline {path}: a directory, not a baseline file; {hint}")
    run_dir = enclosing_run_dir(path)
    if run_dir is not None:
        raise UnsafePathError(
            f"--write-baseline {path}: inside the run directory {run_dir}; a baseline is never written into a run: "
            f"give a path outside it, and {hint}"
        )
    if path.is_file() and path.stat().st_size > 0:
        header = _header(path)
        volatile = [c for c in VOLATILE_COLUMNS if c in header]
        if volatile:
            raise UnsafePathError(
                f"--write-baseline {path}: a run's results file (columns {', '.join(volatile)}), not a baseline; "
                f"refusing to overwrite it, --force or not; {hint}"
            )
        missing = [c for c in BASELINE_COLUMNS if c not in header]
        if missing:
            raise UnsafePathError(
                f"--write-baseline {path}: exists and is not a parity baseline (no column {missing[0]}); "
                "refusing to overwrite it, --force or not"
            )
    return path


def enclosing_run_dir(path: str | Path) -> Path | None:
    """The run directory `path` lies in (a directory above it holding results.csv, or a run.json
    with a run id), or None."""
    for directory in Path(os.path.abspath(path)).parents:
        if (directory / RESULTS_FILE).is_file():
            return directory
        if (directory / RUN_INFO_FILE).is_file():
            try:
                if "run_id" in read_run_info(directory):
                    return directory
            except (ReportError, OSError):
                continue
    return None


def _header(path: Path) -> list[str]:
    """The header of a CSV file ([] when it is not readable text)."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8", newline="") as handle:
            return next(csv.reader([handle.readline()]), [])
    except (OSError, UnicodeDecodeError, EOFError):
        return []


def _number_text(value: float) -> str:
    if pd.isna(value):
        return ""
    return repr(float(value))


def config_text(config: Mapping[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


def row_location(row: pd.Series) -> str:
    """`suite/case/mode @site metric`: where a row is, in one line."""
    site = f" @{row['site']}" if row["site"] else ""
    return f"{row['suite']}/{row['case']}/{row['mode']}{site} {row['metric']}"

"""Baselines: committed expectations per device kind and dtype, and the direction-aware comparison.

A baseline is a run's rows with the volatile columns (run id, time, worker, test, git sha) removed
and the rows sorted, kept at `reports/baselines/<device kind>-<dtype>.csv` (`cpu-fp32.csv`,
`h200-bf16.csv`), so a regenerated baseline diffs line by line in review.

Rows are matched between baseline and run on (suite, case, target, mode, site, metric); the n-th
duplicate of a key matches the n-th duplicate. The rule for a matched row (docs/reports.md §7; why it
is this rule: docs/machine-independence.md):

* **gate row, verdict**: pass / tie_flip in the baseline and fail / error now is a regression; the
  other way round an improvement.
* **a loosened bound**: how a bound is judged depends on how it was set (the `bound` column).
  A *fixed* bound (a policy from a case file) is loosened when the threshold was raised for
  lower-is-better, lowered for higher-is-better, dropped, or an expected value changed for `equal`,
  by more than `FIXED_BOUND_RTOL` (float-repr noise); a *measured* bound (derived from noise
  measured in the same run, e.g. the noise-floor rule) moves with the machine's kernels, and is
  loosened only past `MEASURED_BOUND_FACTOR`; the measured bounds of one (suite, metric) together
  are loosened when their geometric-mean growth exceeds `MEASURED_GROUP_FACTOR` (a policy moves
  them all, noise moves them independently). A fixed bound replaced by a measured one is loosened
  too. A loosened bound is a regression: it hides exactly what the baseline was kept for. Accept it
  by regenerating the baseline.
* **gate row with a fixed bound** (`threshold`, `better` lower or higher): the share of the bound a
  row uses is `value / threshold` (lower is better) or `threshold / value` (higher is better); 1.0
  is at the bound. Measured against the bound in force now, a row whose share rose by more than
  `margin` (default 0.20, a fifth of the allowance) is a regression, one whose share fell by more
  than `margin` an improvement, even when both verdicts pass.
* **gate rows with a measured bound, tie flips on either side, rows without a bound or with
  `better = equal`**: verdicts only; a moved share or value is listed as changed. A measured bound
  and the value held to it are both noise of this machine; their ratio is what the verdict judges.
* **info rows**: counted when they moved by more than `margin` (relative), never a regression; the
  listing names only those that moved by more than `INFO_LIST_FACTOR` (or to / from non-finite).
* **cases**: a case of a compared suite that is in the baseline but not in the run has *vanished*
  (a check that stopped running); a vanished gate row fails the review (a vanished `skip` row does
  not: that test runs now). New cases are listed.
  Suites with no row in the run are not compared (a `--suite` run), and are listed as such; so are
  the rows of a family the run's target does not provide and, between tensor-parallel sizes, the
  mutant catalogue's rows (`not_compared`).
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import math
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from parity.compare import ERROR, FAIL, FIXED, MEASURED, SKIP, TIE_FLIP
from parity.report.audit import audit_records, read_records
from parity.report.quick import baseline_suffix, mismatch_note
from parity.report.rows import (
    CASE_KEYS,
    COLUMNS,
    NOT_PROVIDED,
    RESULTS_FILE,
    RUN_INFO_FILE,
    ReportError,
    read_results,
    read_run_info,
    run_tp,
)
from parity.report.rundir import UnsafePathError, atomic_write

BASELINE_DIR = Path("reports") / "baselines"  # relative to the directory a command runs in
ROW_KEYS = ["suite", "case", "target", "mode", "site", "metric"]
# Columns that change on every run without saying anything about the numbers.
VOLATILE_COLUMNS = ("run_id", "time", "worker", "test", "git_sha")
BASELINE_COLUMNS = tuple(c for c in COLUMNS if c not in VOLATILE_COLUMNS)
# What a baseline is valid for: a run must agree on all of these to be compared with it.
CONFIG_COLUMNS = ("device", "dtype", "size", "target")
# A fifth of a row's allowance: wide enough that rows far from their bound do not trip on
# accumulation-order noise between machines (measured between kernel sets of this CPU: a correct
# run's fixed-bound gate rows moved by up to 0.137 of their allowance, docs/machine-independence.md),
# narrow enough that a row eating a fifth of its allowance is seen long before it fails.
DEFAULT_MARGIN = 0.20
# Two fixed bounds (policies) are the same bound when they agree to this relative tolerance: a
# threshold computed in Python floats from case-file numbers may differ in its last bits between
# code paths (and a baseline stores repr()), while a deliberate change of a policy is never this small.
FIXED_BOUND_RTOL = 1e-9
# A measured bound (multiplier x RMSE(golden, eager) + floor) moves with the kernels row by row: a
# single-weight routing row's bound moved by up to x1.52 between kernel sets of one CPU (x1.00
# between 1 and 2 threads). One row is loosened only past MEASURED_BOUND_FACTOR. A change of policy
# (the multiplier, the floor) moves every row of a rule together, while kernel noise moves rows
# independently (the geometric mean of the ratios stayed within x1.0012 over 512 rows): the
# measured bounds of one (suite, metric) with at least MEASURED_GROUP_MIN rows are loosened when
# their geometric-mean ratio exceeds MEASURED_GROUP_FACTOR. docs/machine-independence.md.
MEASURED_BOUND_FACTOR = 2.0
MEASURED_GROUP_FACTOR = 1.05
MEASURED_GROUP_MIN = 10
# Info rows that moved by more than the margin are counted; those that moved by more than this
# factor (an order of magnitude) are listed by name.
INFO_LIST_FACTOR = 10.0
_FAILING = (FAIL, ERROR)
SENSITIVITY_SUITE = "sensitivity"


class BaselineError(ValueError):
    """A baseline that cannot be used for this run (missing, or made for another configuration)."""


# ---------------------------------------------------------------------------------------------
# Loading and writing
# ---------------------------------------------------------------------------------------------


def load_rows(source: str | Path, *, strict: bool = False) -> pd.DataFrame:
    """Rows of a run directory, a `results.csv` or a baseline CSV, with value/threshold as floats.

    Volatile columns a baseline does not carry come back as empty strings. `strict` (a baseline:
    what a run is judged against must be whole and sound) refuses, with one line naming the file
    and line, a record cut short, a value that is not a number, a verdict, kind, `better` or `bound`
    the writer does not write, and a row whose verdict its numbers contradict (parity.report.audit).
    """
    if strict:
        check_baseline_file(source)
    frame = read_results(source, required=BASELINE_COLUMNS)
    for column in VOLATILE_COLUMNS:
        if column not in frame.columns:
            frame[column] = ""
    return frame[list(COLUMNS)].copy()


def check_baseline_file(source: str | Path) -> None:
    """Raise `BaselineError` (one line: file, line, row, what) unless every record of `source` is a
    whole, sound parity row: a baseline is never read past a torn record or a row the audit refuses."""
    path = Path(source)
    results = path / RESULTS_FILE if path.is_dir() else path
    if not results.exists():
        raise FileNotFoundError(f"no report rows at {results}")
    try:
        records = read_records(results)
    except (ReportError, OSError, EOFError) as exc:  # EOFError: a .gz cut short
        raise BaselineError(f"baseline {path}: {exc}") from None
    if records.torn:
        raise BaselineError(
            f"baseline {records.path} line {records.torn[0]}: a record cut short ({len(records.torn)} in all); "
            "a baseline is never read in part: regenerate it"
        )
    missing = [c for c in BASELINE_COLUMNS if c not in records.header]
    if missing:
        return  # read_results says "not a parity results file" with the columns
    info = read_run_info(path) if path.is_dir() else {}
    problems = audit_records(records, info).problems
    if problems:
        more = f" ({len(problems)} problems in all)" if len(problems) > 1 else ""
        raise BaselineError(f"baseline {records.path.parent}/{problems[0].line()}{more}")


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


def target_name(info: dict[str, Any]) -> str:
    """The name the run's target declares (its `name` attribute, in run.json's `target_provenance`);
    '' for a run recorded before parity kept it, or whose target could not be resolved."""
    provenance = info.get("target_provenance")
    name = provenance.get("name") if isinstance(provenance, dict) else None
    return name if isinstance(name, str) else ""


def default_baseline_path(run_dir: str | Path, frame: pd.DataFrame, baseline_dir: Path = BASELINE_DIR) -> Path:
    """`reports/baselines/<device kind>-<dtype>.csv` (of the working directory) for a run of the
    built-in target in `run_dir`; `<device kind>-<dtype>-<name>.csv` for any other target, keyed by
    the `name` the target declares (run.json), so renaming its adapter module keeps its baseline;
    a run that recorded no name is keyed by its `--target` value."""
    config = run_config(frame, str(run_dir))
    info = read_run_info(Path(run_dir)) if Path(run_dir).is_dir() else {}
    key = target_name(info) or config["target"]
    return _baseline_path(config, info, key, baseline_dir)


def _baseline_path(config: dict[str, str], info: dict[str, Any], key: str, baseline_dir: Path) -> Path:
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
        return f"it was made for {_config_text(old_config)}, this run is {_config_text(new_config)}"
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


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------


def allowance_used(value: float, threshold: float, better: str) -> float:
    """The share of its bound a value uses: 0 = perfect, 1 = at the bound, > 1 = past it.

    NaN when the row has no usable bound or value (such rows are compared by verdict only).
    """
    if pd.isna(value) or pd.isna(threshold) or better not in ("lower", "higher"):
        return math.nan
    if better == "lower":
        if threshold <= 0:
            return 0.0 if value <= 0 else math.inf
        return max(value, 0.0) / threshold
    if value == math.inf:
        return 0.0
    if value <= 0:
        return math.inf
    return threshold / value


def bound_change(old: float, new: float, better: str, kind: str = FIXED) -> str:
    """`loosened`, `tightened`, `changed` (equal rows), `moved` (a measured bound inside its factor)
    or '' for a threshold between two runs (see the module docstring)."""
    if pd.isna(old) and pd.isna(new):
        return ""
    if pd.isna(old):
        return "tightened"  # a bound where there was none
    if pd.isna(new):
        return "loosened"  # the bound was dropped
    if math.isclose(old, new, rel_tol=FIXED_BOUND_RTOL, abs_tol=0.0):
        return ""
    if kind == MEASURED and better in ("lower", "higher") and old > 0 and new > 0:
        grew = new / old if better == "lower" else old / new
        if grew > MEASURED_BOUND_FACTOR:
            return "loosened"
        return "tightened" if grew < 1 / MEASURED_BOUND_FACTOR else "moved"
    if better == "lower":
        return "loosened" if new > old else "tightened"
    if better == "higher":
        return "loosened" if new < old else "tightened"
    return "changed"


def bound_kind(old: pd.Series | None, new: pd.Series | None) -> str:
    """How the bound of a matched row was set: the run's own `bound` column, else the baseline's."""
    for row in (new, old):
        value = row.get("bound", "") if row is not None else ""
        if isinstance(value, str) and value:
            return value
    return ""


@dataclasses.dataclass
class Comparison:
    """A run against a baseline, one frame per outcome (each row: key, old and new numbers, why)."""

    baseline: str
    margin: float
    regressions: pd.DataFrame
    improvements: pd.DataFrame
    new: pd.DataFrame
    vanished: pd.DataFrame
    changed: pd.DataFrame  # gate rows that moved but are neither better nor worse by the rule
    suites_not_run: list[str]
    matched: int
    # baseline rows a run of this target cannot have, and why (`not_compared`) -> how many
    not_compared: dict[str, int] = dataclasses.field(default_factory=dict)
    info_moves: pd.DataFrame = dataclasses.field(default_factory=lambda: pd.DataFrame(columns=OUTCOME_COLUMNS))
    config: str = ""  # the configuration both sides share (what was compared)
    # The cases the baseline holds: a new row of one of them (a failing case's stage chain) is no new case.
    baseline_cases: frozenset[tuple[str, ...]] = frozenset()

    def large_info_moves(self) -> pd.DataFrame:
        """Info rows that moved by more than `INFO_LIST_FACTOR`, or to / from a non-finite value."""
        if self.info_moves.empty:
            return self.info_moves
        large = [
            _moved_by_factor(o, n, INFO_LIST_FACTOR) for o, n in zip(self.info_moves["old_value"], self.info_moves["new_value"])
        ]
        return self.info_moves[large]

    @property
    def vanished_gate_rows(self) -> int:
        return int((self.vanished["kind"] != "info").sum())

    @property
    def ok(self) -> bool:
        """No regression and no vanished gate row (a check that stopped running is a lost check)."""
        return self.regressions.empty and self.vanished_gate_rows == 0

    def new_cases(self) -> pd.DataFrame:
        """Cases the baseline does not hold, with their rows (new rows of a case it holds are not one)."""
        if self.new.empty or not self.baseline_cases:
            return _cases(self.new)
        held = [tuple(key) in self.baseline_cases for key in self.new[CASE_KEYS].itertuples(index=False)]
        return _cases(self.new[[not h for h in held]])

    def vanished_cases(self) -> pd.DataFrame:
        return _cases(self.vanished)


OUTCOME_COLUMNS: list[str] = ROW_KEYS + [
    "kind",
    "better",
    "bound",
    "old_value",
    "new_value",
    "threshold",
    "old_verdict",
    "new_verdict",
    "why",
]


def _cases(rows: pd.DataFrame) -> pd.DataFrame:
    if rows.empty:
        return pd.DataFrame(columns=CASE_KEYS + ["rows", "gate_rows"])
    grouped = rows.groupby(CASE_KEYS, sort=False)
    return pd.DataFrame(
        {"rows": grouped.size(), "gate_rows": grouped["kind"].agg(lambda k: int((k != "info").sum()))}
    ).reset_index()


def _keyed(frame: pd.DataFrame) -> pd.DataFrame:
    keyed = frame.copy()
    keyed["_n"] = keyed.groupby(ROW_KEYS, sort=False).cumcount()
    return keyed


def _fmt(value: float) -> str:
    return "" if pd.isna(value) else f"{value:.4g}"


def _judge(old: pd.Series, new: pd.Series, margin: float) -> tuple[str, str]:
    """(outcome, why) for one matched row: regression, improvement, changed, info or ''."""
    is_gate = new["kind"] != "info"
    better = new["better"]
    if not is_gate:
        if _moved(old["value"], new["value"], margin):
            direction = _direction(old["value"], new["value"], better)
            return "info", f"info {direction}: moved more than {margin:.0%}"
        return "", ""
    was_failing, is_failing = old["verdict"] in _FAILING, new["verdict"] in _FAILING
    if is_failing and not was_failing:
        return "regression", f"verdict {old['verdict']} -> {new['verdict']}"
    if was_failing and not is_failing:
        return "improvement", f"verdict {old['verdict']} -> {new['verdict']}"
    kind = bound_kind(old, new)
    old_kind = old.get("bound", "") if isinstance(old.get("bound", ""), str) else ""
    bounds = f"{_fmt(old['threshold'])} -> {_fmt(new['threshold'])}"
    if old_kind == FIXED and kind == MEASURED:
        return "regression", f"bound loosened: a fixed bound became a measured one: {bounds}"
    change = bound_change(old["threshold"], new["threshold"], better, kind)
    if change in ("loosened", "changed"):
        factor = f" (more than x{MEASURED_BOUND_FACTOR:g} for a measured bound)" if kind == MEASURED else ""
        return "regression", f"bound {change}{factor}: {bounds}"
    used_old = allowance_used(old["value"], new["threshold"], better)
    used_new = allowance_used(new["value"], new["threshold"], better)
    delta = used_new - used_old
    share = f"{_share(used_old)} -> {_share(used_new)} of the bound"
    by_verdict = kind == MEASURED or TIE_FLIP in (old["verdict"], new["verdict"])
    notes = []
    if not pd.isna(delta) and abs(delta) > margin:
        if not by_verdict:
            if delta > margin:
                return "regression", f"worse: uses {share}"
            return "improvement", f"better: uses {share}"
        why = "a measured bound" if kind == MEASURED else "a tie flip"
        notes.append(f"uses {share} ({why}: judged by verdict)")
    if change == "tightened":
        notes.append(f"bound tightened: {bounds}")
    elif change == "moved" and _moved(old["threshold"], new["threshold"], margin):
        notes.append(f"measured bound moved: {bounds} (within x{MEASURED_BOUND_FACTOR:g})")
    if old["verdict"] != new["verdict"]:
        notes.append(f"verdict {old['verdict']} -> {new['verdict']}")
    if pd.isna(used_old) and _moved(old["value"], new["value"], margin):
        notes.append("value changed (compared by verdict only)")
    return ("changed", "; ".join(notes)) if notes else ("", "")


def _share(used: float) -> str:
    return "inf" if used == math.inf else f"{used:.1%}"


def _moved(old: float, new: float, margin: float) -> bool:
    """Relative move above `margin` (NaN <-> number counts as a move; two NaNs do not)."""
    if pd.isna(old) and pd.isna(new):
        return False
    if pd.isna(old) or pd.isna(new):
        return True
    if old == new:
        return False
    scale = max(abs(old), abs(new))
    return scale == math.inf or abs(new - old) / scale > margin


def _measured_growth(old: pd.Series, new: pd.Series) -> float | None:
    """log(new / old) of a gate row's measured bound, in the loosening direction; None otherwise."""
    if new["kind"] == "info" or bound_kind(old, new) != MEASURED or new["better"] not in ("lower", "higher"):
        return None
    a, b = old["threshold"], new["threshold"]
    if pd.isna(a) or pd.isna(b) or not (0 < a < math.inf and 0 < b < math.inf):
        return None
    return math.log(b / a) if new["better"] == "lower" else math.log(a / b)


def _moved_by_factor(old: float, new: float, factor: float) -> bool:
    """|new| and |old| differ by more than `factor`, or one of them is NaN / infinite (and not both)."""
    if pd.isna(old) or pd.isna(new) or math.isinf(old) or math.isinf(new):
        return not (pd.isna(old) and pd.isna(new)) and old != new
    small, large = sorted((abs(old), abs(new)))
    return large > factor * small


def _direction(old: float, new: float, better: str) -> str:
    if better not in ("lower", "higher") or pd.isna(old) or pd.isna(new):
        return "changed"
    worse = new > old if better == "lower" else new < old
    return "worse" if worse else "better"


def compare_rows(
    baseline: pd.DataFrame,
    current: pd.DataFrame,
    *,
    margin: float = DEFAULT_MARGIN,
    name: str = "",
    baseline_kind: str | None = None,
    run_kind: str | None = None,
) -> Comparison:
    """Direction-aware comparison of a run's rows with a baseline's (see the module docstring).

    A baseline is valid for one configuration: one device, dtype, size and target in its rows (and,
    where both are known, one device kind: an H200 baseline does not judge an A100 run); another
    one, or a baseline without rows, is a BaselineError, never a silent comparison."""
    if not margin >= 0:
        raise ValueError(f"margin must be a non-negative fraction of the bound, got {margin!r}")
    config_text = ""
    if baseline.empty:
        raise BaselineError(f"baseline {name or ''}: no rows (nothing to compare with)")
    if not current.empty:
        old_config, new_config = run_config(baseline, name or "baseline"), run_config(current, "run")
        if old_config != new_config:
            quick = mismatch_note(old_config["size"], new_config["size"])  # never compared as if one (parity.report.quick)
            raise BaselineError(
                f"baseline {name or ''} was made for {_config_text(old_config)}, this run is {_config_text(new_config)}: "
                + (f"{quick}; " if quick else "")
                + "pass --baseline for this configuration or write one with --write-baseline"
            )
        if baseline_kind and run_kind and baseline_kind != run_kind:
            raise BaselineError(
                f"baseline {name or ''} was made on device kind {baseline_kind}, this run on {run_kind} "
                f"({_config_text(new_config)}): pass --baseline for this device or write one with --write-baseline"
            )
        kind = f" ({run_kind or baseline_kind or 'device kind unknown'})" if new_config["device"] == "cuda" else ""
        config_text = _config_text(new_config).replace(f"device={new_config['device']}", f"device={new_config['device']}{kind}")
    suites_run = set(current["suite"])
    not_run = sorted(set(baseline["suite"]) - suites_run)
    left_out = not_compared(baseline, current)
    compared = baseline[baseline["suite"].isin(suites_run)]
    for mask in left_out.values():
        compared = compared[~mask.reindex(compared.index, fill_value=False)]
    old = _keyed(compared)
    new = _keyed(current)
    merged = old.merge(new, on=ROW_KEYS + ["_n"], how="outer", suffixes=("_old", "_new"), indicator=True)

    buckets: dict[str, list[dict[str, Any]]] = {
        "regression": [],
        "improvement": [],
        "changed": [],
        "info": [],
        "new": [],
        "vanished": [],
    }
    growth: dict[tuple[str, str], list[float]] = {}  # (suite, metric) -> log growth of measured bounds
    matched = 0
    for _, row in merged.iterrows():
        side = row["_merge"]
        old_row = _side(row, "_old")
        new_row = _side(row, "_new")
        record = {k: row[k] for k in ROW_KEYS}
        if side == "right_only":
            buckets["new"].append(_outcome(record, None, new_row, "new"))
            continue
        if side == "left_only":
            if old_row["verdict"] == SKIP:
                why = "vanished skip row (the test runs now)"
            else:
                why = "vanished gate row" if old_row["kind"] != "info" else "vanished info row"
            buckets["vanished"].append(_outcome(record, old_row, None, why))
            continue
        matched += 1
        verdict, why = _judge(old_row, new_row, margin)
        if verdict:
            buckets[verdict].append(_outcome(record, old_row, new_row, why))
        grew = _measured_growth(old_row, new_row)
        if grew is not None:
            growth.setdefault((record["suite"], record["metric"]), []).append(grew)
    for (suite, metric), logs in growth.items():
        mean = math.exp(sum(logs) / len(logs))
        if len(logs) >= MEASURED_GROUP_MIN and mean > MEASURED_GROUP_FACTOR:
            example = current[(current["suite"] == suite) & (current["metric"] == metric)].iloc[0]
            buckets["regression"].append(
                {
                    **dict.fromkeys(ROW_KEYS, ""),
                    "suite": suite,
                    "case": f"({len(logs)} rows)",
                    "target": example["target"],
                    "metric": metric,
                    "kind": "gate",
                    "better": example["better"],
                    "bound": MEASURED,
                    "old_value": math.nan,
                    "new_value": math.nan,
                    "threshold": math.nan,
                    "old_verdict": "",
                    "new_verdict": "",
                    "why": f"bound loosened: the measured bounds grew by x{mean:.3g} (geometric mean over {len(logs)} rows; "
                    f"kernel noise moves it by less than x{MEASURED_GROUP_FACTOR:g}): a changed multiplier or floor",
                }
            )
    frames = {k: pd.DataFrame(v, columns=OUTCOME_COLUMNS) for k, v in buckets.items()}
    return Comparison(
        baseline=name,
        config=config_text,
        margin=margin,
        regressions=frames["regression"],
        improvements=frames["improvement"],
        new=frames["new"],
        vanished=frames["vanished"],
        changed=frames["changed"],
        suites_not_run=not_run,
        not_compared={why: int(mask.sum()) for why, mask in left_out.items() if mask.any()},
        matched=matched,
        info_moves=frames["info"],
        baseline_cases=frozenset(old[CASE_KEYS].itertuples(index=False, name=None)),
    )


def not_compared(baseline: pd.DataFrame, current: pd.DataFrame) -> dict[str, pd.Series]:
    """Baseline rows the run cannot have, by reason (a mask over `baseline` each): the rows of a
    model family the run's target does not provide (its `family_not_provided` rows name them; the
    baseline's `family` column places each row), and, between tensor-parallel sizes, the mutant
    catalogue's rows (the sensitivity suite runs the mutants of its own size: docs/mutants.md)."""
    reasons: dict[str, pd.Series] = {}
    not_provided = current[(current["metric"] == NOT_PROVIDED) & (current["verdict"] == SKIP)]
    families = sorted(set(not_provided["case"]))
    if families:
        # a (suite, family) the run left out, not the family alone: a row whose family column is
        # wrong for its suite is compared, and cannot hide a vanished case of a suite that ran
        left_out = set(zip(not_provided["suite"], not_provided["case"], strict=True))
        mask = pd.Series(
            [pair in left_out for pair in zip(baseline["suite"], baseline["family"], strict=True)], index=baseline.index
        )
        reasons[f"families this target does not provide ({', '.join(families)})"] = mask
    current_tp, baseline_tp = run_tp(current), run_tp(baseline)
    if current_tp != baseline_tp:
        mask = baseline["suite"] == SENSITIVITY_SUITE
        reasons[f"sensitivity (the mutants of tp {baseline_tp}; this run holds those of tp {current_tp})"] = mask
    return reasons


def _config_text(config: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


def _side(row: pd.Series, suffix: str) -> pd.Series:
    columns = [c for c in row.index if c.endswith(suffix)]
    return pd.Series({c[: -len(suffix)]: row[c] for c in columns})


def _outcome(record: dict[str, Any], old: pd.Series | None, new: pd.Series | None, why: str) -> dict[str, Any]:
    ref = new if new is not None else old
    assert ref is not None  # an outcome has a row on one side at least
    return {
        **record,
        "kind": ref["kind"],
        "better": ref["better"],
        "bound": bound_kind(old, new),
        "old_value": old["value"] if old is not None else math.nan,
        "new_value": new["value"] if new is not None else math.nan,
        "threshold": ref["threshold"],
        "old_verdict": old["verdict"] if old is not None else "",
        "new_verdict": new["verdict"] if new is not None else "",
        "why": why,
    }


def format_comparison(comparison: Comparison, *, limit: int = 20) -> str:
    """The comparison as terminal text: regressions, improvements, new and vanished cases, moves."""
    compared = f" of {comparison.config}" if comparison.config else ""
    lines = [
        f"baseline {comparison.baseline}: {comparison.matched} rows{compared} matched, margin {comparison.margin:.0%} of the bound"
    ]
    if comparison.suites_not_run:
        lines.append(f"  not compared (no rows in this run): {', '.join(comparison.suites_not_run)}")
    for why, count in comparison.not_compared.items():
        lines.append(f"  not compared ({count} baseline rows): {why}")
    for title, frame in (
        ("regressions", comparison.regressions),
        ("improvements", comparison.improvements),
    ):
        lines.append(f"  {title}: {len(frame)}")
        lines += [f"    {_row_text(r)}" for _, r in frame.head(limit).iterrows()]
        if len(frame) > limit:
            lines.append(f"    ... {len(frame) - limit} more")
    for title, cases in (("new cases", comparison.new_cases()), ("vanished cases", comparison.vanished_cases())):
        note = " (a vanished gate row fails the review)" if title == "vanished cases" and len(cases) else ""
        lines.append(f"  {title}: {len(cases)}{note}")
        for _, c in cases.head(limit).iterrows():
            lines.append(f"    {c['suite']}/{c['case']}/{c['target']}/{c['mode']} ({c['rows']} rows, {c['gate_rows']} gate)")
        if len(cases) > limit:
            lines.append(f"    ... {len(cases) - limit} more")
    changed = comparison.changed
    lines.append(f"  changed gate rows, neither better nor worse by the rule: {len(changed)}")
    lines += [f"    {_row_text(r)}" for _, r in changed.head(limit).iterrows()]
    if len(changed) > limit:
        lines.append(f"    ... {len(changed) - limit} more")
    large = comparison.large_info_moves()
    lines.append(
        f"  info rows moved more than {comparison.margin:.0%}: {len(comparison.info_moves)} (never a regression); "
        f"by more than x{INFO_LIST_FACTOR:g}: {len(large)}"
    )
    lines += [f"    {_row_text(r)}" for _, r in large.head(limit).iterrows()]
    if len(large) > limit:
        lines.append(f"    ... {len(large) - limit} more")
    return "\n".join(lines)


def row_location(row: pd.Series) -> str:
    site = f" @{row['site']}" if row["site"] else ""
    return f"{row['suite']}/{row['case']}/{row['mode']}{site} {row['metric']}"


def _row_text(row: pd.Series) -> str:
    bound = "" if pd.isna(row["threshold"]) else f" (bound {_fmt(row['threshold'])})"
    return f"{row_location(row)}: {_fmt(row['old_value']) or '-'} -> {_fmt(row['new_value']) or '-'}{bound}: {row['why']}"

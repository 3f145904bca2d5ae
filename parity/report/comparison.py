"""The direction-aware comparison of a run with its baseline (docs/reports.md §7).

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

import dataclasses
import math
from typing import Any

import pandas as pd

from parity.compare import ERROR, FAIL, FIXED, MEASURED, SKIP, TIE_FLIP
from parity.report.baseline import BaselineError, config_text, run_config
from parity.report.quick import mismatch_note
from parity.report.schema import CASE_KEYS, NOT_PROVIDED, ROW_KEYS, SENSITIVITY_SUITE
from parity.report.summary import run_tp

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


def fmt_value(value: float) -> str:
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
    bounds = f"{fmt_value(old['threshold'])} -> {fmt_value(new['threshold'])}"
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
    compared_config = ""
    if baseline.empty:
        raise BaselineError(f"baseline {name or ''}: no rows (nothing to compare with)")
    if not current.empty:
        old_config, new_config = run_config(baseline, name or "baseline"), run_config(current, "run")
        if old_config != new_config:
            quick = mismatch_note(old_config["size"], new_config["size"])  # never compared as if one (parity.report.quick)
            raise BaselineError(
                f"baseline {name or ''} was made for {config_text(old_config)}, this run is {config_text(new_config)}: "
                + (f"{quick}; " if quick else "")
                + "pass --baseline for this configuration or write one with --write-baseline"
            )
        if baseline_kind and run_kind and baseline_kind != run_kind:
            raise BaselineError(
                f"baseline {name or ''} was made on device kind {baseline_kind}, this run on {run_kind} "
                f"({config_text(new_config)}): pass --baseline for this device or write one with --write-baseline"
            )
        kind = f" ({run_kind or baseline_kind or 'device kind unknown'})" if new_config["device"] == "cuda" else ""
        compared_config = config_text(new_config).replace(
            f"device={new_config['device']}", f"device={new_config['device']}{kind}"
        )
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
        config=compared_config,
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

"""Baselines and the direction-aware comparison: the rule row by row, and `parity review`'s exit codes
on a real tiny run with an injected regression, improvement, vanished case and new case."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from parity.cli import main
from parity.report import comparison as comparison_mod
from parity.report import read_results
from parity.report.baseline import (
    BASELINE_COLUMNS,
    VOLATILE_COLUMNS,
    BaselineError,
    default_baseline_path,
    device_kind,
    load_rows,
    write_baseline,
)
from parity.report.comparison import MEASURED_BOUND_FACTOR, MEASURED_GROUP_MIN, allowance_used, compare_rows
from parity.report.review import format_comparison
from tests.support.helpers import PROJECT_ROOT, run_parity
from tests.support.shared_run import SharedRun, copy_run, write_rows

COMMITTED_CPU_BASELINE = PROJECT_ROOT / "reports" / "baselines" / "cpu-fp32.csv"


# ---------------------------------------------------------------------------------------------
# The rule, on explicit rows (a template row of the real run carries the context columns)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def template(suites_run: SharedRun) -> pd.Series:
    return read_results(suites_run.run_dir).iloc[0]


def rows(template: pd.Series, *specs: dict) -> pd.DataFrame:
    base = {"site": "", "detail": "", "kind": "gate", "better": "lower", "verdict": "pass", "threshold": math.nan, "bound": ""}
    return pd.DataFrame([{**template.to_dict(), **base, **spec} for spec in specs])


def one(template: pd.Series, **spec) -> pd.DataFrame:
    spec = {"suite": "numerics", "case": "c", "metric": "max_abs", **spec}
    return rows(template, spec)


def test_a_gate_row_using_more_of_its_bound_than_the_margin_is_a_regression(template: pd.Series) -> None:
    old = one(template, value=1e-6, threshold=1e-5)  # 10% of the bound
    new = one(template, value=3.5e-6, threshold=1e-5)  # 35%: still passing, 25 points worse
    result = compare_rows(old, new)
    assert len(result.regressions) == 1 and result.improvements.empty and not result.ok
    assert "worse: uses 10.0% -> 35.0% of the bound" in result.regressions.iloc[0]["why"]
    # Within the margin it is not a regression; nor is the same move the other way.
    assert compare_rows(old, one(template, value=1.9e-6, threshold=1e-5)).ok
    back = compare_rows(new, old)
    assert back.ok and len(back.improvements) == 1 and "better" in back.improvements.iloc[0]["why"]


def test_direction_comes_from_better_higher_means_a_drop_is_worse(template: pd.Series) -> None:
    old = one(template, metric="psnr", better="higher", value=60.0, threshold=40.0)  # uses 2/3 of the bound
    worse = one(template, metric="psnr", better="higher", value=45.0, threshold=40.0)  # uses 8/9
    better = one(template, metric="psnr", better="higher", value=math.inf, threshold=40.0)  # identical images
    assert len(compare_rows(old, worse).regressions) == 1
    assert compare_rows(old, better).ok and len(compare_rows(old, better).improvements) == 1


def test_a_direction_blind_rule_would_miss_the_psnr_drop(template: pd.Series, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: read every metric as lower-is-better and the PSNR drop above is not caught."""
    blind = comparison_mod.allowance_used
    monkeypatch.setattr(comparison_mod, "allowance_used", lambda value, threshold, better: blind(value, threshold, "lower"))
    old = one(template, metric="psnr", better="higher", value=60.0, threshold=40.0)
    worse = one(template, metric="psnr", better="higher", value=45.0, threshold=40.0)
    assert compare_rows(old, worse).regressions.empty


def test_verdicts_decide_rows_without_a_bound_and_beat_the_margin(template: pd.Series) -> None:
    old = one(template, metric="assertion", value=math.nan)
    new = one(template, metric="assertion", value=math.nan, verdict="fail")
    result = compare_rows(old, new)
    assert list(result.regressions["why"]) == ["verdict pass -> fail"]
    assert list(compare_rows(new, old).improvements["why"]) == ["verdict fail -> pass"]
    # pass -> tie_flip is a change (a decision inside the dtype's noise), not a regression.
    flip = compare_rows(old, one(template, metric="assertion", value=math.nan, verdict="tie_flip"))
    assert flip.ok and "verdict pass -> tie_flip" in flip.changed.iloc[0]["why"]


def test_a_loosened_bound_is_a_regression_a_tightened_one_is_not(template: pd.Series) -> None:
    old = one(template, value=1e-7, threshold=1e-5)
    loosened = compare_rows(old, one(template, value=1e-7, threshold=1e-4))
    assert "bound loosened: 1e-05 -> 0.0001" in loosened.regressions.iloc[0]["why"]
    tightened = compare_rows(old, one(template, value=1e-7, threshold=1e-6))
    assert tightened.ok and "bound tightened" in tightened.changed.iloc[0]["why"]
    dropped = compare_rows(old, one(template, value=1e-7))
    assert "bound loosened: 1e-05 -> " in dropped.regressions.iloc[0]["why"]
    added = compare_rows(one(template, value=1e-7), old)
    assert added.ok and "bound tightened" in added.changed.iloc[0]["why"]
    higher = one(template, metric="psnr", better="higher", value=50.0, threshold=40.0)
    assert not compare_rows(higher, one(template, metric="psnr", better="higher", value=50.0, threshold=30.0)).ok


def test_info_rows_are_reported_but_never_fail(template: pd.Series) -> None:
    old = one(template, metric="rel_l2", kind="info", value=1e-7)
    new = one(template, metric="rel_l2", kind="info", value=5e-7, verdict="fail")
    result = compare_rows(old, new)
    assert result.ok and result.regressions.empty and result.changed.empty
    assert "info worse" in result.info_moves.iloc[0]["why"]


def test_info_moves_are_counted_and_only_large_ones_listed(template: pd.Series) -> None:
    """Info rows are noise metrics (max ULP, rel L2, ...): between kernel sets they move by a few
    times; the listing names those that moved by more than an order of magnitude or went non-finite."""
    specs = [
        ("small", 1.85e5, 8.7e5),
        ("large", 1e-8, 3e-6),
        ("from-zero", 0.0, 2e-7),
        ("nan", 1.0, math.nan),
        ("still", 1.0, 1.05),
    ]
    old = rows(
        template, *({"suite": "numerics", "case": c, "metric": "max_ulp", "kind": "info", "value": v} for c, v, _ in specs)
    )
    new = rows(
        template, *({"suite": "numerics", "case": c, "metric": "max_ulp", "kind": "info", "value": v} for c, _, v in specs)
    )
    result = compare_rows(old, new)
    assert result.ok and sorted(result.info_moves["case"]) == ["from-zero", "large", "nan", "small"]
    assert sorted(result.large_info_moves()["case"]) == ["from-zero", "large", "nan"]
    text = format_comparison(result)
    assert "info rows moved more than 20%: 4 (never a regression); by more than x10: 3" in text
    assert "numerics/large/" in text and "numerics/small/" not in text


# ---------------------------------------------------------------------------------------------
# Bounds: fixed (a policy) vs measured (noise of this run), tie flips
# ---------------------------------------------------------------------------------------------


def test_a_fixed_bound_equal_up_to_float_repr_is_unchanged(template: pd.Series) -> None:
    old = one(template, value=1e-7, threshold=0.1 + 0.2)
    same = compare_rows(old, one(template, value=1e-7, threshold=0.3))  # 0.30000000000000004 vs 0.3
    assert same.ok and same.changed.empty
    raised = compare_rows(old, one(template, value=1e-7, threshold=0.3 * (1 + 1e-6)))  # a real (if tiny) change
    assert "bound loosened" in raised.regressions.iloc[0]["why"]


def test_a_measured_bound_moving_with_the_kernels_is_not_loosened_past_the_factor_it_is(template: pd.Series) -> None:
    """The issue's rows: `rmse_vs_golden 5.996e-09 -> 8.116e-09 (bound 2.243e-07): bound loosened:
    2.18e-07 -> 2.243e-07`, a noise-floor bound re-measured on another kernel set."""
    spec = dict(suite="routing", metric="rmse_vs_golden", bound="measured")
    old = one(template, value=5.996e-9, threshold=2.18e-7, **spec)
    moved = compare_rows(old, one(template, value=8.116e-9, threshold=2.243e-7, **spec))
    assert moved.ok and moved.regressions.empty
    grown = 2.18e-7 * MEASURED_BOUND_FACTOR * 1.01
    loosened = compare_rows(old, one(template, value=8.116e-9, threshold=grown, **spec))
    assert f"bound loosened (more than x{MEASURED_BOUND_FACTOR:g} for a measured bound)" in loosened.regressions.iloc[0]["why"]
    # The same numbers as a fixed bound (a policy) are a loosening.
    fixed = compare_rows(one(template, value=5.996e-9, threshold=2.18e-7), one(template, value=8.116e-9, threshold=2.243e-7))
    assert "bound loosened: 2.18e-07 -> 2.243e-07" in fixed.regressions.iloc[0]["why"]
    # A policy replaced by a measurement is a loosening whatever the numbers.
    swapped = compare_rows(
        one(template, value=1e-9, threshold=2.18e-7, **{**spec, "bound": "fixed"}),
        one(template, value=1e-9, threshold=2.18e-7, **spec),
    )
    assert "a fixed bound became a measured one" in swapped.regressions.iloc[0]["why"]


def test_measured_bounds_that_grow_together_are_a_loosened_policy(template: pd.Series) -> None:
    """Kernel noise moves each measured bound its own way (up to x1.52 on one row between kernel
    sets, geometric mean within x1.0012 over the 512 routing rows); a changed multiplier or floor
    moves all of them at once."""
    n = MEASURED_GROUP_MIN * 2
    spec = lambda i, bound: {
        "suite": "routing",
        "case": f"grid-{i}",
        "metric": "rmse_vs_golden",
        "value": 1e-8,
        "threshold": bound,
        "bound": "measured",
    }
    old = rows(template, *(spec(i, 2.2e-7) for i in range(n)))
    noisy = rows(
        template, *(spec(i, 2.2e-7 * (1.45 if i % 2 else 1 / 1.4)) for i in range(n))
    )  # each row moves, the mean does not
    assert compare_rows(old, noisy).ok
    policy = rows(template, *(spec(i, 2.2e-7 * 1.15) for i in range(n)))  # every row 15% looser: within the per-row factor
    result = compare_rows(old, policy)
    assert len(result.regressions) == 1
    why = result.regressions.iloc[0]["why"]
    assert result.regressions.iloc[0]["case"] == f"({n} rows)" and "the measured bounds grew by x1.15" in why
    few = compare_rows(old.head(MEASURED_GROUP_MIN - 1), policy.head(MEASURED_GROUP_MIN - 1))
    assert few.ok  # too few rows to tell a policy from noise: the per-row factor alone decides


def test_measured_bound_rows_are_judged_by_verdict(template: pd.Series) -> None:
    spec = dict(suite="numerics", metric="rmse_vs_golden", bound="measured")
    old = one(template, value=1e-7, threshold=1e-6, **spec)  # 10% of its bound
    busier = compare_rows(old, one(template, value=6e-7, threshold=1e-6, **spec))  # 60%: kernels' noise, not a regression
    assert busier.ok and "(a measured bound: judged by verdict)" in busier.changed.iloc[0]["why"]
    failed = compare_rows(old, one(template, value=2e-6, threshold=1e-6, verdict="fail", **spec))
    assert list(failed.regressions["why"]) == ["verdict pass -> fail"]
    # A fixed bound with the same numbers keeps the margin rule.
    assert (
        "worse: uses 10.0% -> 60.0%"
        in compare_rows(one(template, value=1e-7, threshold=1e-6), one(template, value=6e-7, threshold=1e-6)).regressions.iloc[0][
            "why"
        ]
    )


def test_tie_flip_rows_are_judged_by_verdict(template: pd.Series) -> None:
    """A greedy decode that tie-flips at step 10 on another CPU matched 10 of 64 steps: its share
    of the bound jumps, but a tie flip is a decision inside the dtype's noise."""
    spec = dict(suite="decode", metric="matched_steps", better="higher", threshold=64.0)
    result = compare_rows(one(template, value=64.0, **spec), one(template, value=10.0, verdict="tie_flip", **spec))
    assert result.ok and "(a tie flip: judged by verdict)" in result.changed.iloc[0]["why"]
    assert not compare_rows(one(template, value=64.0, **spec), one(template, value=10.0, verdict="fail", **spec)).ok


def test_rows_match_on_site_and_duplicates_match_in_order(template: pd.Series) -> None:
    old = rows(
        template,
        *(
            {"suite": "numerics", "case": "c", "metric": "max_abs", "site": f"layer.{i}", "value": 0.0, "threshold": 1e-5}
            for i in range(3)
        ),
    )
    new = old.copy()
    new.loc[new["site"] == "layer.2", "value"] = 9e-6
    result = compare_rows(old, new)
    assert list(result.regressions["site"]) == ["layer.2"]
    dup_old = rows(
        template,
        {"suite": "s", "case": "c", "metric": "m", "value": 1.0, "threshold": 10.0},
        {"suite": "s", "case": "c", "metric": "m", "value": 2.0, "threshold": 10.0},
    )
    dup_new = dup_old.copy()
    dup_new.loc[1, "value"] = 9.0
    assert list(compare_rows(dup_old, dup_new).regressions["old_value"]) == [2.0]


def test_new_and_vanished_cases_and_suites_not_run(template: pd.Series) -> None:
    old = rows(
        template,
        {"suite": "numerics", "case": "kept", "metric": "max_abs", "value": 0.0, "threshold": 1e-5},
        {"suite": "numerics", "case": "gone", "metric": "max_abs", "value": 0.0, "threshold": 1e-5},
        {"suite": "numerics", "case": "gone-info", "metric": "rel_l2", "value": 0.0, "kind": "info"},
        {"suite": "routing", "case": "grid", "metric": "ids_mismatch", "value": 0.0, "threshold": 0.0},
    )
    new = rows(
        template,
        {"suite": "numerics", "case": "kept", "metric": "max_abs", "value": 0.0, "threshold": 1e-5},
        {"suite": "numerics", "case": "fresh", "metric": "max_abs", "value": 0.0, "threshold": 1e-5},
    )
    result = compare_rows(old, new)
    assert list(result.new_cases()["case"]) == ["fresh"]
    assert sorted(result.vanished_cases()["case"]) == ["gone", "gone-info"]
    assert result.vanished_gate_rows == 1 and not result.ok and result.regressions.empty
    assert result.suites_not_run == ["routing"]  # a --suite run is not a vanished suite
    only_info_gone = compare_rows(old[old["case"] != "gone"], new[new["case"] != "fresh"])
    assert only_info_gone.ok and len(only_info_gone.vanished) == 1


def test_a_baseline_of_another_configuration_is_refused(template: pd.Series) -> None:
    old = one(template, value=0.0, threshold=1e-5)
    new = one(template, value=0.0, threshold=1e-5, dtype="bf16")
    with pytest.raises(BaselineError, match="dtype=fp32.*dtype=bf16"):
        compare_rows(old, new, name="cpu-fp32.csv")


def test_allowance_used_edges() -> None:
    assert allowance_used(0.0, 0.0, "lower") == 0.0 and allowance_used(1e-9, 0.0, "lower") == math.inf
    assert allowance_used(math.inf, 40.0, "higher") == 0.0 and allowance_used(0.0, 40.0, "higher") == math.inf
    assert math.isnan(allowance_used(1.0, math.nan, "lower")) and math.isnan(allowance_used(1.0, 1.0, "equal"))


def test_device_kind_and_default_path(suites_run: SharedRun) -> None:
    assert device_kind("cuda", "NVIDIA H200") == "h200"
    assert device_kind("cuda", "NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert device_kind("cpu", "x86_64") == "cpu"
    path = default_baseline_path(suites_run.run_dir, read_results(suites_run.run_dir))
    assert path == PROJECT_ROOT / "reports" / "baselines" / "cpu-fp32.csv"


# ---------------------------------------------------------------------------------------------
# Real runs under other kernel sets: a correct run reviews clean, a mutant's run does not
# ---------------------------------------------------------------------------------------------

# Recorded with this tree's `parity run` (every suite but sensitivity and benchmarks, -n 2) on an
# Intel Xeon with AVX-512 and AMX, torch 2.13.0 CPU, under six kernel sets, and once with
# `--target parity.suites.ar.mutants:mutant_rmsnorm_eps_1e_5` (default kernels, 1 thread); kept as baselines
# (volatile columns dropped) with the detail text blanked to keep them small. The names say the
# kernel set: ATEN_CPU_CAPABILITY (avx512 = the CPU's own; sse4_2 and avx2 also set
# MKL_ENABLE_INSTRUCTIONS) and PARITY_CPU_THREADS. docs/machine-independence.md tabulates them.
KERNEL_SET_RUNS = PROJECT_ROOT / "tests" / "data" / "kernel_sets"
CROSS_KERNEL_PAIRS = [
    ("avx512-t1", "default-t1"),
    ("default-t1", "avx512-t1"),  # the committed baseline's kernels vs ATen's default
    ("avx512-t1", "avx512-t2"),
    ("avx512-t2", "avx512-t1"),  # 1 vs 2 threads
    ("default-t2", "avx512-t1"),
    ("avx512-t2", "default-t1"),  # both at once
    ("avx2-t1", "sse4_2-t1"),
    ("sse4_2-t1", "avx2-t1"),  # the pair whose fixed-bound rows moved most (0.137 of a bound)
]


@pytest.fixture(scope="module")
def recorded() -> dict[str, pd.DataFrame]:
    return {path.name.removesuffix(".csv.gz"): load_rows(path) for path in sorted(KERNEL_SET_RUNS.glob("*.csv.gz"))}


@pytest.mark.parametrize(
    "baseline_run, reviewed", CROSS_KERNEL_PAIRS, ids=[f"{a}-reviewed-by-{b}" for a, b in CROSS_KERNEL_PAIRS]
)
@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_a_correct_run_reviews_clean_against_a_baseline_of_another_kernel_set(recorded, baseline_run: str, reviewed: str) -> None:
    result = compare_rows(recorded[baseline_run], recorded[reviewed], name=baseline_run)
    assert result.matched > 4000 and result.new.empty and result.vanished.empty
    assert result.ok and result.regressions.empty, format_comparison(result)


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_the_old_rule_flagged_those_runs_and_the_margin_is_measured(recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variants: every bound read as a policy (the old rule) and the old 10% margin."""
    assert compare_rows(recorded["avx512-t1"], recorded["default-t1"]).ok
    monkeypatch.setattr(comparison_mod, "bound_kind", lambda old, new: "fixed")
    as_policies = compare_rows(recorded["avx512-t1"], recorded["default-t1"])
    assert len(as_policies.regressions) > 100 and as_policies.regressions["why"].str.startswith("bound loosened").all()
    monkeypatch.undo()
    tenth = compare_rows(recorded["avx2-t1"], recorded["sse4_2-t1"], margin=0.10)
    assert list(tenth.regressions["metric"]) == ["max_abs"] and "worse: uses" in tenth.regressions.iloc[0]["why"]


@pytest.mark.parametrize("baseline_run", ["avx512-t1", "default-t1"])
@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_a_mutants_run_still_shows_regressions_against_any_kernel_set(recorded, baseline_run: str) -> None:
    """RMSNorm eps 1e-5 instead of 1e-6 in the serving model, its rows labelled as the built-in
    target's (the defect as if it had landed there; a baseline of another target is refused)."""
    mutant = recorded["mutant-rmsnorm-eps-default-t1"]
    assert set(mutant["target"]) == {"parity.suites.ar.mutants:mutant_rmsnorm_eps_1e_5"}
    result = compare_rows(recorded[baseline_run], mutant.assign(target="serving"))
    assert not result.ok and len(result.regressions) > 100
    assert {"numerics", "decode"} <= set(result.regressions["suite"])
    assert (result.regressions["why"] == "verdict pass -> fail").all()


# ---------------------------------------------------------------------------------------------
# Writing a baseline
# ---------------------------------------------------------------------------------------------


def test_a_written_baseline_drops_volatile_columns_sorts_and_round_trips(suites_run: SharedRun, tmp_path: Path) -> None:
    frame = read_results(suites_run.run_dir)
    path = write_baseline(frame.iloc[::-1], tmp_path / "b.csv")  # reversed: the file must not care
    text = path.read_text()
    header = text.splitlines()[0].split(",")
    assert header == list(BASELINE_COLUMNS) and not set(VOLATILE_COLUMNS) & set(header)
    again = write_baseline(frame, tmp_path / "again.csv").read_text()
    assert again == text  # row order of the run does not reach the file
    loaded = load_rows(path)
    assert compare_rows(loaded, frame).ok and compare_rows(loaded, frame).changed.empty
    assert len(loaded) == len(frame)


def test_a_failing_run_is_not_written_as_a_baseline(suites_run: SharedRun, tmp_path: Path) -> None:
    frame = read_results(suites_run.run_dir)
    frame.loc[frame.index[0], "verdict"] = "fail"
    with pytest.raises(BaselineError, match="refusing to write a baseline from a run with 1 failing gate row"):
        write_baseline(frame, tmp_path / "b.csv")
    assert not (tmp_path / "b.csv").exists()


# ---------------------------------------------------------------------------------------------
# `parity review` on the real tiny run: injected changes and exit codes
# ---------------------------------------------------------------------------------------------


def _low_share_gate_row(frame: pd.DataFrame) -> int:
    """Index of a passing lower-is-better gate row with a positive bound, using the least of it."""
    candidates = frame[
        (frame["kind"] != "info")
        & (frame["better"] == "lower")
        & (frame["verdict"] == "pass")
        & (frame["threshold"] > 0)
        & frame["value"].notna()
    ]
    share = candidates["value"] / candidates["threshold"]
    assert not share.empty and share.min() < 0.3, "the tiny run needs a gate row far from its bound"
    return int(share.idxmin())


@pytest.fixture
def reviewed(suites_run: SharedRun, tmp_path: Path) -> tuple[Path, Path, pd.DataFrame]:
    """A copy of the tiny run, its baseline (written with --write-baseline), and its rows."""
    run_dir = copy_run(suites_run.run_dir, tmp_path / "run")
    base = tmp_path / "baselines" / "cpu-fp32.csv"
    assert main(["review", str(run_dir), "--no-baseline", "--write-baseline", str(base)]) == 0
    return run_dir, base, read_results(run_dir)


def test_review_against_its_own_baseline_is_clean(reviewed, capsys: pytest.CaptureFixture) -> None:
    run_dir, base, _ = reviewed
    assert main(["review", str(run_dir), "--baseline", str(base)]) == 0
    out = capsys.readouterr().out
    assert "regressions: 0" in out and "OK: 0 failing case(s), 0 regression(s)" in out


def test_injected_regression_exits_1_and_is_named(reviewed, capsys: pytest.CaptureFixture) -> None:
    run_dir, base, frame = reviewed
    i = _low_share_gate_row(frame)
    frame.loc[i, "value"] = frame.loc[i, "value"] + 0.6 * frame.loc[i, "threshold"]  # worse, still under the bound
    write_rows(run_dir, frame)
    capsys.readouterr()
    assert main(["review", str(run_dir), "--baseline", str(base)]) == 1
    out = capsys.readouterr().out
    row = frame.loc[i]
    assert "regressions: 1" in out and f"{row['suite']}/{row['case']}/{row['mode']}" in out and "worse: uses" in out
    assert "FAILED: 0 failing case(s), 1 regression(s)" in out


def test_injected_improvement_exits_0_and_is_named(reviewed, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    run_dir, base, frame = reviewed
    old = load_rows(base)
    i = _low_share_gate_row(old)
    old.loc[i, "value"] = old.loc[i, "value"] + 0.6 * old.loc[i, "threshold"]  # the baseline was worse
    worse_base = tmp_path / "worse.csv"
    write_baseline(old, worse_base)
    capsys.readouterr()
    assert main(["review", str(run_dir), "--baseline", str(worse_base)]) == 0
    out = capsys.readouterr().out
    assert "improvements: 1" in out and "better: uses" in out and "regressions: 0" in out


def test_vanished_case_exits_1_and_new_case_exits_0(reviewed, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    run_dir, base, frame = reviewed
    gates = frame[frame["kind"] != "info"]
    # a case of a suite that keeps other cases (a suite with no row left is not compared at all),
    # run in one mode (one vanished case), whatever order the rows were written in (docs/cli.md §11)
    per_suite = gates.groupby("suite")["case"].transform("nunique")
    modes = gates.groupby(["suite", "case"])["mode"].transform("nunique")
    gone = gates[(per_suite > 1) & (modes == 1)].iloc[-1]
    keep = ~((frame["suite"] == gone["suite"]) & (frame["case"] == gone["case"]))
    write_rows(run_dir, frame[keep])
    capsys.readouterr()
    assert main(["review", str(run_dir), "--baseline", str(base)]) == 1
    out = capsys.readouterr().out
    assert "vanished cases: 1 (a vanished gate row fails the review)" in out and f"{gone['suite']}/{gone['case']}/" in out
    # The other way round: the case is new in the run, which is listed and does not fail.
    smaller = tmp_path / "smaller.csv"
    write_baseline(frame[keep], smaller)
    write_rows(run_dir, frame)
    capsys.readouterr()
    assert main(["review", str(run_dir), "--baseline", str(smaller)]) == 0
    assert "new cases: 1" in capsys.readouterr().out


def test_a_failing_row_exits_1_even_without_a_baseline(reviewed, capsys: pytest.CaptureFixture) -> None:
    run_dir, _, frame = reviewed
    i = _low_share_gate_row(frame)
    frame.loc[i, ["value", "verdict", "detail"]] = [frame.loc[i, "threshold"] * 2, "fail", "injected failure"]
    write_rows(run_dir, frame)
    capsys.readouterr()
    assert main(["review", str(run_dir), "--no-baseline"]) == 1
    out = capsys.readouterr().out
    row = frame.loc[i]
    (line,) = [line for line in out.splitlines() if line.strip().startswith(f"{row['case']}/{row['mode']}: ")]
    assert "injected failure" in line and "(bound " in line, out  # the failing case's one line (docs/reports.md §5)


def test_unusable_inputs_exit_2(reviewed, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir, base, frame = reviewed
    assert main(["review", str(tmp_path / "nowhere")]) == 2
    other = load_rows(base).assign(dtype="bf16")
    other.to_csv(tmp_path / "bf16.csv", index=False)
    capsys.readouterr()
    assert main(["review", str(run_dir), "--baseline", str(tmp_path / "bf16.csv")]) == 2
    assert "was made for device=cpu dtype=bf16" in capsys.readouterr().err


def test_the_committed_cpu_baseline_is_clean_against_a_fresh_run(suites_run: SharedRun, tmp_path: Path) -> None:
    """`parity review` with no --baseline picks reports/baselines/cpu-fp32.csv (device kind + dtype).
    Every suite of the run is compared in full (a run without sensitivity, under a second kernel
    set in `.ci/run`, leaves that suite out: a suite without rows is not compared)."""
    assert COMMITTED_CPU_BASELINE.is_file(), (
        "regenerate with: parity run --run-id cpu-baseline && parity review reports/runs/cpu-baseline --write-baseline"
    )
    run_dir = copy_run(suites_run.run_dir, tmp_path / "run")
    result = run_parity(["review", str(run_dir)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"baseline {COMMITTED_CPU_BASELINE}:" in result.stdout and "regressions: 0" in result.stdout


def test_without_run_dir_the_latest_run_is_reviewed(suites_run: SharedRun, tmp_path: Path) -> None:
    import os

    from parity.report.review import latest_run_dir

    older, newer = copy_run(suites_run.run_dir, tmp_path / "a-older"), copy_run(suites_run.run_dir, tmp_path / "b-newer")
    (tmp_path / "c-empty").mkdir()  # a run directory without rows is not a candidate
    os.utime(older / "results.csv", (1_000_000_000, 1_000_000_000))
    assert latest_run_dir(tmp_path) == newer
    os.utime(newer / "results.csv", (900_000_000, 900_000_000))
    assert latest_run_dir(tmp_path) == older
    with pytest.raises(FileNotFoundError, match="no run directories"):
        latest_run_dir(tmp_path / "c-empty")

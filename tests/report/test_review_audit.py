"""The review's audit (docs/reports.md §1): every verdict derived again from the row's own numbers
with the suites' rules, and every real row accepted.

Rows of real runs first (the committed baselines, the lane's run: not one row may be flagged), then
the rule row by row on rows each rule writes (a pass and a fail of every direction, +inf PSNR, a
tie flip, a benchmark's unbounded measurement, the noise floor's pre-check), then the broken
variants: each rule switched off lets its row through.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest

from parity.compare import count_rule, equality_rule, flag_rule, threshold_rule
from parity.compare.rules import AT_LEAST, AT_MOST, EXACTLY
from parity.report import COLUMNS, read_run_info
from parity.report import audit as audit_mod
from parity.report.audit import DECISION_METRICS, audit_file, rule_changes, verdict_problem
from parity.report.baseline import BaselineError, load_rows
from parity.report.review import load_review
from parity.report.rows import read_records
from parity.report.schema import ROW_KEYS
from tests.support.helpers import PROJECT_ROOT
from tests.support.shared_run import SharedRun

BASELINES = PROJECT_ROOT / "reports" / "baselines"


def gate(verdict: str = "pass", value: object = "", threshold: object = "", better: str = "lower", **more: str) -> dict[str, str]:
    """A gate row as text, as read back from results.csv."""
    row = dict.fromkeys(COLUMNS, "")
    row.update(suite="s", case="c", target="serving", mode="eager", metric="m", kind="gate", verdict=verdict, better=better)
    row.update(value=str(value), threshold=str(threshold), bound="fixed" if threshold != "" else "")
    row.update(more)
    return row


# ---------------------------------------------------------------------------------------------
# Real rows: nothing is flagged
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cpu-fp32.csv", "h200-bf16.csv"])
def test_every_row_of_the_committed_baselines_passes_the_audit(name: str) -> None:
    """Both committed baselines, the H200 one with its tie flips (decode's matched_steps), read
    strictly as a baseline is: no row is flagged."""
    records = read_records(BASELINES / name)
    assert len(records.whole) > 4000 and not records.torn
    assert audit_file(BASELINES / name).problems == []
    assert not load_rows(BASELINES / name, strict=True).empty
    if name == "h200-bf16.csv":
        tie_flips = [r for _, r in records.whole if r["verdict"] == "tie_flip"]
        assert tie_flips and {r["metric"] for r in tie_flips} <= set(DECISION_METRICS)


def test_every_row_of_a_real_run_passes_the_audit(lane_run: SharedRun) -> None:
    """The lane's run (`parity run`, every suite) against its run.json and the committed CPU
    baseline: no row, no key, no rule change is flagged."""
    audit = audit_file(lane_run.run_dir, read_run_info(lane_run.run_dir))
    assert audit.rows > 4000 and audit.problems == [], [p.line() for p in audit.problems[:5]]
    review = load_review(lane_run.run_dir, baseline=BASELINES / "cpu-fp32.csv")
    assert review.disagreements == [] and review.unusable == [], [p.line() for p in review.disagreements[:5]]


# ---------------------------------------------------------------------------------------------
# The rule, row by row: what each rule of parity.compare writes is accepted, the contrary is not
# ---------------------------------------------------------------------------------------------


def _as_row(verdict: object, better: str) -> dict[str, str]:
    """A row as the report fixture writes a `Verdict` (value, threshold, verdict, bound)."""
    return gate(verdict.verdict, verdict.value, verdict.threshold, better, bound=verdict.bound)


@pytest.mark.parametrize(
    "verdict, better",
    [
        (count_rule(0, 0, metric="mismatched_tokens", at=AT_MOST), "lower"),
        (count_rule(3, 0, metric="mismatched_tokens", at=AT_MOST), "lower"),
        (count_rule(2, 1, metric="modules_compiled", at=AT_LEAST), "higher"),
        (count_rule(0, 1, metric="modules_compiled", at=AT_LEAST), "higher"),
        (count_rule(4, 4, metric="new_compiles", at=EXACTLY), "equal"),
        (count_rule(5, 4, metric="new_compiles", at=EXACTLY), "equal"),
        (threshold_rule(1e-8, 3e-8, metric="rmse_vs_golden", bound="measured"), "lower"),
        (threshold_rule(5e-8, 3e-8, metric="rmse_vs_golden", bound="measured"), "lower"),
        (threshold_rule(math.nan, 3e-8, metric="rmse_vs_golden"), "lower"),
        (threshold_rule(math.inf, 40.0, metric="psnr", at=AT_LEAST), "higher"),  # identical images
        (threshold_rule(20.0, 40.0, metric="psnr", at=AT_LEAST), "higher"),
        (flag_rule(True, metric="capture_refused"), "equal"),
        (flag_rule(False, metric="capture_refused"), "equal"),
        (equality_rule([1, 2], [1, 2], metric="moe_layers_match"), "equal"),
        (equality_rule([1], [1, 2], metric="moe_layers_match"), "equal"),
    ],
)
def test_the_verdict_each_rule_writes_is_the_one_the_audit_derives(verdict: object, better: str) -> None:
    assert verdict_problem(_as_row(verdict, better)) is None


@pytest.mark.parametrize(
    "row, said",
    [
        (gate("pass", 5, 1), "recorded pass, derived fail: value 5 against at most 1 (lower is better)"),
        (gate("pass", 20, 40, "higher"), "recorded pass, derived fail: value 20 against at least 40 (higher is better)"),
        (gate("pass", 2, 1, "equal"), "recorded pass, derived fail: value 2 against exactly 1 (equal is better)"),
        (gate("pass", 5, 1, ""), "recorded pass, derived fail: value 5 against at most 1 (lower is better)"),
        (gate("fail", 0, 1), "recorded fail, derived pass"),
        (gate("pass", "nan", 1), "recorded pass with value nan"),
        (gate("pass", "inf", 1), "recorded pass with value inf"),
        (gate("pass", "-inf", 1), "recorded pass with value -inf"),
        (gate("pass", 1, "inf"), "recorded pass against a threshold of inf"),
        (gate("pass", "", 1), "recorded pass with no value"),
        (gate("tie_flip", 3, 64, "higher", metric="rmse_vs_golden"), "rmse_vs_golden is not a decision"),
        (gate("tie_flip", 64, 64, "higher", metric="matched_steps"), "recorded tie_flip, derived pass"),
        (gate("tie_flip", 3, "", "higher", metric="matched_steps"), "recorded tie_flip with no threshold"),
        (gate("not_applicable", "", 1), "recorded not_applicable, but the row holds a threshold"),
        (gate("skip", "", 1), "recorded skip, but the row holds a threshold"),
    ],
)
def test_a_verdict_its_numbers_contradict_is_named(row: dict[str, str], said: str) -> None:
    problem = verdict_problem(row)
    assert problem is not None and said in problem, problem


@pytest.mark.parametrize(
    "row",
    [
        gate("tie_flip", 3, 64, "higher", metric="matched_steps"),  # decode: a greedy flip inside the noise (h200-bf16.csv)
        gate("tie_flip", 2, 0, "lower", metric="ids_mismatch"),  # routing: expert ids flipped inside the noise
        gate("pass", 1.7, "", "higher", metric="graph_speedup", suite="benchmark"),  # a measurement, no bound
        gate("fail", "", ""),  # a bare assert's row
        gate("error", "", ""),  # the check raised
        gate("error", 5, 1),  # whatever numbers an error row holds, it fails the review as it is
        gate("not_applicable", "", ""),
        gate("fail", 0, 1e-5, detail="weights: non-finite: mismatched=3"),  # allclose: NaN where the reference has none
        gate("pass", 5e-6, 1e-6, bound="measured", detail="allclose to eager; weights: rmse(golden,cand)=5e-6"),
    ],
)
def test_rows_the_suites_write_are_accepted(row: dict[str, str]) -> None:
    assert verdict_problem(row) is None


def _audit_rows(tmp_path: Path, *rows: dict[str, str]) -> list[str]:
    path = tmp_path / "results.csv"
    pd.DataFrame(list(rows), columns=list(COLUMNS)).to_csv(path, index=False)
    return [p.line() for p in audit_file(path).problems]


def test_an_info_row_may_carry_its_gate_rows_failure_but_not_hide_one(tmp_path: Path) -> None:
    """report.diff writes its info rows with the gate row's verdict; a failure only an info row
    records is a failing gate row turned into info."""
    info = gate("fail", 0.5, "", "higher", kind="info", metric="cosine")
    assert _audit_rows(tmp_path, gate("fail", 5, 1), info) == []
    (problem,) = _audit_rows(tmp_path, gate("pass", 0, 1), info)
    assert "line 3 (s/c/eager cosine): an info row recorded fail, but no gate row of its case is fail or error" in problem
    flip = gate("tie_flip", 1.5, 2, "", kind="info", metric="tie_flip_max_margin_ulps")  # routing's, beside its ids row
    assert _audit_rows(tmp_path, gate("tie_flip", 1, 0, metric="ids_mismatch"), flip) == []
    assert "an info row recorded tie_flip" in _audit_rows(tmp_path, gate("pass", 0, 0, metric="ids_mismatch"), flip)[0]
    assert "an info row recorded pass, derived fail" in _audit_rows(tmp_path, gate("pass", 5, 1, kind="info"))[0]


def test_rows_of_one_run_share_their_provenance(tmp_path: Path) -> None:
    row = gate("pass", 0, 1, run_id="r", device="cpu", dtype="fp32", size="tiny", torch_version="2.13.0+cpu")
    assert _audit_rows(tmp_path, row, row) == []
    for column, other in (("device", "cuda"), ("dtype", "bf16"), ("size", "full"), ("target", "ref"), ("torch_version", "2.11")):
        (problem,) = _audit_rows(tmp_path, row, {**row, column: other})
        assert f"line 3 (s/c/eager m): {column} {other!r}, but line 2 says" in problem


# ---------------------------------------------------------------------------------------------
# Baselines are read strictly; a gate row's rule may not change against its baseline
# ---------------------------------------------------------------------------------------------


def _baseline(tmp_path: Path, text_edit) -> Path:
    path = tmp_path / "baselines" / "cpu-fp32.csv"
    path.parent.mkdir(parents=True)
    text = (BASELINES / "cpu-fp32.csv").read_text()
    path.write_text(text_edit(text))
    return path


def test_a_baseline_cut_short_is_refused_not_read_in_part(tmp_path: Path) -> None:
    path = _baseline(tmp_path, lambda text: text[: len(text) - 40])
    lines = path.read_text().count("\n") + 1
    with pytest.raises(BaselineError, match=rf"cpu-fp32.csv line {lines}: a record cut short"):
        load_rows(path, strict=True)
    # the broken variant, a baseline read as a run is: the record is silently left out
    assert len(load_rows(path)) == len(load_rows(BASELINES / "cpu-fp32.csv")) - 1


def test_a_baseline_with_a_bogus_bound_is_refused(tmp_path: Path) -> None:
    path = _baseline(tmp_path, lambda text: re.sub(r",measured,(\w*)\n", r",bogus,\1\n", text, count=1))
    with pytest.raises(BaselineError, match=r"cpu-fp32.csv line \d+ \(\w+/.*\): bound 'bogus' is not one of fixed, measured"):
        load_rows(path, strict=True)
    assert "bogus" in set(load_rows(path)["bound"])  # the broken variant: used without a word


def test_a_gate_row_whose_rule_changed_against_the_baseline_fails_the_review() -> None:
    old = load_rows(BASELINES / "cpu-fp32.csv")
    new = old.copy()
    psnr = new.index[(new["metric"] == "psnr_vs_golden") & (new["kind"] == "gate")][0]
    killed = new.index[new["metric"] == "killed"][0]
    new.loc[psnr, "better"] = ""  # PSNR read as lower-is-better: a drop would pass
    new.loc[killed, "kind"] = "info"  # a mutant's verdict that no longer counts
    lines = [p.line() for p in rule_changes(old, new, ROW_KEYS, "cpu-fp32.csv")]
    assert len(lines) == 2
    assert any("psnr_vs_golden: better 'higher' in the baseline cpu-fp32.csv, '' now" in line for line in lines)
    assert any("killed: a gate row in the baseline cpu-fp32.csv, recorded as info now" in line for line in lines)
    assert rule_changes(old, old.copy(), ROW_KEYS, "cpu-fp32.csv") == []


# ---------------------------------------------------------------------------------------------
# Broken variants: each rule switched off lets its row through
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "row, switch_off",
    [
        (gate("pass", 5, 1), lambda patch: patch.setattr(audit_mod, "_holds", lambda *a: True)),
        (gate("pass", 20, 40, "higher"), lambda patch: patch.setattr(audit_mod, "_holds", lambda v, t, b: v <= t)),
        (
            gate("tie_flip", 5e-8, 3e-8, metric="rmse_vs_golden"),
            lambda patch: patch.setattr(audit_mod, "DECISION_METRICS", ("rmse_vs_golden",)),
        ),
        (
            gate("pass", 5e-6, 1e-6, bound="measured", detail="allclose to eager; weights: rmse(golden,cand)=5e-6"),
            lambda patch: patch.setattr(audit_mod, "PRECHECK_PASS", "(no exception)"),
        ),
    ],
)
def test_the_rules_are_what_catch_these(row: dict[str, str], switch_off, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rule switched off changes its row's answer: a pass above its bound, a PSNR below its
    floor read in the wrong direction, a tie flip on a number that is not a decision are flagged,
    and pass once their rule is gone; the noise floor's pre-check pass (docs/tolerances.md §2) is
    accepted, and a variant without that exception would flag a real routing row."""
    before = verdict_problem(row)
    switch_off(monkeypatch)
    assert (before is None) != (verdict_problem(row) is None), before

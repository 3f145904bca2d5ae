"""The summary says which way a bound holds and what an interrupted sensitivity run left out:
`block_compiles=2 (bound ≥ 1)` for a higher-is-better row, and a mutation score that counts the
mutants that did not run."""

from __future__ import annotations

import pandas as pd

from parity.report import summarize
from parity.report.mutation import MutationScore


def _frame(better: str, value: float, threshold: float) -> pd.DataFrame:
    row = {
        "suite": "recompiles",
        "case": "c",
        "target": "serving",
        "mode": "compiled",
        "metric": "block_compiles",
        "value": value,
        "threshold": threshold,
        "verdict": "pass",
        "kind": "gate",
        "better": better,
    }
    return pd.DataFrame([row])


def test_the_worst_column_shows_the_direction_of_the_bound() -> None:
    assert "block_compiles=2 (bound ≥ 1)" in summarize(_frame("higher", 2, 1))["worst"].iloc[0]
    assert "(bound ≤ 1e-05)" in summarize(_frame("lower", 1e-6, 1e-5))["worst"].iloc[0]
    assert "(bound = 3)" in summarize(_frame("equal", 3, 3))["worst"].iloc[0]


def test_an_interrupted_sensitivity_run_says_how_many_mutants_did_not_run() -> None:
    score = MutationScore(killed=26, applicable=27, not_applicable=["n"], survivors=["s"], per_suite={"image": (26, 27)})
    line = score.line(catalogue=47)
    assert line.startswith("mutation score: 26/27 applicable mutants killed")
    assert "19 of the catalogue's 47 mutants DID NOT RUN" in line and "covers 28" in line
    assert "DID NOT RUN" not in score.line(catalogue=28)

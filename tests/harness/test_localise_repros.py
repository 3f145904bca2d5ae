"""A failing case's repro runs standalone: `python repro.py` from another directory, parity installed,
in seconds, and shows the divergence the chain named (docs/localise.md §5). One mutant per family."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from parity.report import read_results
from tests.support.helpers import PROJECT_ROOT, run_command, run_pytest

pytestmark = [pytest.mark.parity_cpu, pytest.mark.parity_slow]

CASES = {
    "ar": (
        "parity.suites.ar.mutants:mutant_rope_theta_default",
        ("parity/suites/ar/test_numerics.py", "-k", "layer_by_layer and eager and mixed"),
        "layer.0.q_rope",
    ),
    "dit": (
        "parity.suites.dit.mutants:qk_norm_weights_swapped",
        ("parity/suites/dit/test_numerics.py", "-k", "velocity and reference and text4"),
        "context_refiner.0.q_norm",
    ),
    "routing": (
        "parity.suites.routing.mutants:serving_renormalize_ignored",
        ("parity/suites/routing/test_grid.py", "-k", "grid-softmax-E8-k2-T64-fp32-renorm"),
        "weights",
    ),
}


@pytest.mark.parametrize("family", list(CASES))
def test_a_mutants_repro_runs_standalone_in_seconds(family: str, tmp_path: Path) -> None:
    target, selection, stage = CASES[family]
    result = run_pytest(
        [*selection, "-q", "--parity-target", target, "--parity-report-dir", str(tmp_path), "--parity-run-id", "r"],
        cwd=PROJECT_ROOT,
    )
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    frame = read_results(tmp_path / "r")
    blamed = frame[(frame["metric"] == "first_diverging_stage") & (frame["site"] == stage)]
    assert not blamed.empty, frame[frame["metric"] == "first_diverging_stage"][["case", "site", "detail"]].to_string()
    detail = str(blamed["detail"].iloc[0])
    assert "; repro: repro/" in detail, detail
    repro = tmp_path / "r" / detail.rsplit("; repro: ", 1)[1]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ran = run_command([sys.executable, str(repro)], cwd=elsewhere)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert f"stage {stage}" in ran.stdout and "DIVERGED" in ran.stdout, ran.stdout

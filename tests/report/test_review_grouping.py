"""`parity review` lists a failing case (case, mode) in one line, and the rows of any other verdict that
differ only in `mode` as one line naming their modes, the worst value and its bound, and how many
rows they are (docs/reports.md §8)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from parity.cli import main
from parity.report import ReportWriter, write_run_info
from parity.report.review import format_review, load_review

CONTEXT = {"run_id": "r", "target": "serving", "device": "cpu", "dtype": "fp32", "size": "tiny", "torch_version": "2.13.0+cpu"}
DEFECT = {"suite": "numerics", "case": "prompt-mixed", "site": "layer.0", "metric": "rmse_vs_golden", "threshold": 1e-4}


def _row(mode: str, value: float, **more: Any) -> dict[str, Any]:
    verdict = "fail" if value > 1e-4 else "pass"
    row = {**DEFECT, "mode": mode, "value": value, "verdict": verdict, "kind": "gate", "better": "lower", "bound": "fixed"}
    return {**row, **more}


ROWS = [
    _row("eager", 2.0e-2, detail="eager: layer 0 drifts"),
    _row("cpu_graph", 3.1e-2, detail="cpu_graph: layer 0 drifts"),
    _row("compiled", 1.0e-6),  # the same check passes in this mode
    _row("eager", 5.0e-3, case="prompt-short"),  # another case: a line of its own
    _row("eager", 1.0e-6, case="prompt-long"),
]


def make_run(run_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """A complete run directory as the plugin writes one (run.json at the first row)."""
    info = {"run_id": run_dir.name, "status": "complete", "pid": os.getpid(), "host": os.uname().nodename, "seed": 0}
    info.update({k: CONTEXT[k] for k in ("device", "dtype", "size", "target")}, torch=CONTEXT["torch_version"])
    writer = ReportWriter(run_dir, {**CONTEXT, "run_id": run_dir.name}, on_create=lambda d: write_run_info(d, info))
    for row in rows:
        writer.write(row)
    return run_dir


def test_a_failing_case_is_one_line_per_mode_in_layer_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = make_run(tmp_path / "run", ROWS)
    assert main(["review", str(run_dir), "--no-baseline"]) == 1
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("prompt-")]
    assert lines == [
        "prompt-mixed/eager: @layer.0 — rmse_vs_golden 0.02 (bound ≤ 0.0001): eager: layer 0 drifts",
        "prompt-mixed/cpu_graph: @layer.0 — rmse_vs_golden 0.031 (bound ≤ 0.0001): cpu_graph: layer 0 drifts",
        "prompt-short/eager: @layer.0 — rmse_vs_golden 0.005 (bound ≤ 0.0001)",
    ], out
    assert "FAILED: 3 failing case(s)" in out  # the summary counts (case, mode) pairs


def test_the_lines_left_out_are_counted(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", ROWS)
    text = format_review(load_review(run_dir, use_default_baseline=False), limit=1)
    assert "prompt-mixed/eager: @layer.0" in text, text
    assert "  ... 2 more failing cases (all of them:" in text, text


def test_other_verdicts_of_one_check_across_modes_are_one_line(tmp_path: Path) -> None:
    flips = [_row(mode, 2.0e-2, verdict="tie_flip", detail=f"{mode}: a tie") for mode in ("eager", "cpu_graph")]
    run_dir = make_run(tmp_path / "run", flips)
    text = format_review(load_review(run_dir, use_default_baseline=False))
    (line,) = [line for line in text.splitlines() if line.startswith("  tie_flip ")]
    assert "numerics/prompt-mixed @layer.0 rmse_vs_golden [eager, cpu_graph]" in line, line
    assert "worst 0.02 (bound 0.0001, lower is better; 2 rows)" in line, line


def test_show_all_groups_passing_rows_too(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", ROWS)
    text = format_review(load_review(run_dir, use_default_baseline=False), show_all=True)
    passing = [line for line in text.splitlines() if line.startswith("  pass ")]
    assert [line.split()[1] for line in passing] == ["numerics/prompt-mixed", "numerics/prompt-long"], text
    assert "[compiled] 1e-06" in passing[0], passing

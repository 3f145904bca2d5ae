"""The `routing` suite on CUDA: real CUDA-graph replay, the host-read mutant failing its capture,
and the rank- cases over NCCL when two GPUs are present. Each run is a fresh pytest process (a
failed CUDA capture poisons the process that tried it). Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from parity.compare import ERROR, FAIL
from tests.support.helpers import PROJECT_ROOT, run_pytest

pytestmark = pytest.mark.parity_gpu

SUITE_FILES = [
    "parity/suites/routing/test_grid.py",
    "parity/suites/routing/test_edges.py",
    "parity/suites/routing/test_invariance.py",
    "parity/suites/routing/test_consumers.py",
    "parity/suites/routing/test_ranks.py",
]


def run_on_cuda(tmp_path: Path, target: str, selection: str) -> tuple[int, pd.DataFrame, str]:
    result = run_pytest(
        [
            *SUITE_FILES,
            "-q",
            "--parity-device",
            "cuda",
            "--parity-size",
            "full",
            "-k",
            selection,
            "--parity-target",
            target,
            "--parity-report-dir",
            str(tmp_path),
            "--parity-run-id",
            "run",
        ],
        cwd=PROJECT_ROOT,
    )
    csv = tmp_path / "run" / "results.csv"
    frame = pd.read_csv(csv, dtype=str, keep_default_na=False) if csv.exists() else pd.DataFrame()
    return result.returncode, frame, result.stdout[-4000:] + result.stderr[-4000:]


def failing(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["kind"] == "gate") & frame["verdict"].isin([FAIL, ERROR])]


def test_suite_passes_on_cuda_with_cuda_graph_replay(tmp_path: Path) -> None:
    code, frame, output = run_on_cuda(
        tmp_path, "serving", "replay or pad- or tie- or nan- or batch- or load- or ranks or E256-k8"
    )
    assert code == 0, output
    assert failing(frame).empty
    replay = frame[frame["case"].str.startswith("replay-")]
    assert not replay.empty and set(replay["mode"]) == {"cuda_graph"}
    assert frame["device"].eq("cuda").all()
    rank = frame[frame["case"].str.startswith("rank-")]
    expected = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    backend_rows = rank[rank["metric"] == "ranks_disagree"]  # the row of each case that names the backend
    assert not backend_rows.empty and backend_rows["detail"].str.contains(expected).all()


def test_count_read_on_the_host_fails_the_cuda_graph_capture(tmp_path: Path) -> None:
    code, frame, output = run_on_cuda(tmp_path, "parity.suites.routing.mutants:serving_count_on_host", "replay")
    assert code != 0, output
    errors = failing(frame)
    assert not errors.empty and (errors["metric"] == "capture").all(), errors[["case", "metric", "detail"]].to_string()
    assert errors["detail"].str.contains("CUDA graph capture").all()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL rank- cases need 2 GPUs")
def test_rank_cases_over_nccl_catch_a_router_that_ignores_the_count(tmp_path: Path) -> None:
    code, frame, output = run_on_cuda(tmp_path, "parity.suites.routing.mutants:serving_ignores_valid_rows", "ranks")
    assert code != 0, output
    bad = failing(frame)
    assert not bad.empty and bad["case"].str.startswith("rank-").all()
    assert frame["detail"].str.contains("nccl").any()

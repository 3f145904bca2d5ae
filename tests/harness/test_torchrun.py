"""Ranks launched by torchrun (`torch.distributed.run`), the way sharded engines are launched: one
agent with two ranks running `parity run --tp 2`, and two agents on this machine as two "nodes"
(c10d rendezvous on localhost, one rank each) running the pytest form, `pytest --parity-tp 2`.
Each gives a green TP=2 run whose review against the single-process baseline is clean
(docs/lanes.md §5)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from parity.observe.progress import communicate_watched
from parity.report import read_results, read_run_info
from tests.support.helpers import PROJECT_ROOT, default_signals, plugin_args, run_parity, subprocess_env

pytestmark = [pytest.mark.parity_cpu, pytest.mark.parity_slow]

COMMITTED_CPU_BASELINE = PROJECT_ROOT / "reports" / "baselines" / "cpu-fp32.csv"
SUITE = "embedding_clamp"  # an AR suite whose forwards run sharded in every CPU mode, compiled included


def _torchrun(agent: list[str], command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *agent, *command],
        cwd=PROJECT_ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_signals,
    )


def _finished(process: subprocess.Popen) -> tuple[int, str]:
    """The agent's exit code and output; a launch that stops making progress is killed by the
    stall guard (docs/cli.md §9), never by a deadline a loaded machine could miss."""
    output, _ = communicate_watched(process)
    return process.returncode, output


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _green_and_clean(run_dir: Path, output: str) -> None:
    """Every row at tp 2 and no failing gate; rank 1's verdicts handed to rank 0; the review against
    the committed single-process baseline exits 0 with no regression and nothing vanished."""
    info = read_run_info(run_dir)
    assert info["status"] == "complete" and info["tp"] == 2, info
    assert set(info["ranks"]["peers"]) == {"1"} and not info["ranks"]["unfinished"], info["ranks"]
    rows = read_results(run_dir)
    assert set(rows["tp"].astype(str)) == {"2"}
    gates = rows[rows["kind"] == "gate"]
    assert len(gates) and not gates["verdict"].isin(["fail", "error"]).any(), output[-3000:]
    assert {"eager", "cpu_graph", "compiled"} <= set(gates["mode"])
    assert (run_dir / "ranks" / "rank-1" / "results.csv").is_file()  # the peer's own rows (one machine here)
    review = run_parity(["review", str(run_dir), "--baseline", str(COMMITTED_CPU_BASELINE)])
    assert review.returncode == 0, review.stdout + review.stderr
    assert "regressions: 0" in review.stdout and "vanished cases: 0" in review.stdout, review.stdout


def test_one_torchrun_agent_with_two_ranks_runs_parity_run(tmp_path: Path) -> None:
    command = ["-m", "parity", "run", "--tp", "2", "--suite", SUITE, "--report-dir", str(tmp_path), "--run-id", "one"]
    code, output = _finished(_torchrun(["--standalone", "--nproc-per-node", "2"], command))
    assert code == 0, output[-4000:]
    assert f"review page: {tmp_path / 'one' / 'index.html'}" in output  # rank 0 is parity run: summary and page
    _green_and_clean(tmp_path / "one", output)


def test_two_torchrun_agents_as_two_nodes_run_the_pytest_form(tmp_path: Path) -> None:
    """Two agents meet through c10d on localhost (one hosts the rendezvous store), one rank each;
    the rendezvous decides which of them is rank 0. Both end 0 and the one run is rank 0's."""
    port = _free_port()
    command = ["-m", "pytest", "-p", "no:cacheprovider", *plugin_args(), "parity/suites", "-m", "parity_cpu"]
    command += ["--parity-tp", "2", "--parity-suite", SUITE, "--parity-report-dir", str(tmp_path), "--parity-run-id", "two"]
    agents = [
        _torchrun(
            [
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "parity-two-nodes",
                "--rdzv-conf",
                f"is_host={int(node == 0)}",
            ],
            command,
        )
        for node in range(2)
    ]
    ended = [_finished(agent) for agent in agents]
    output = "\n".join(text for _, text in ended)
    assert [code for code, _ in ended] == [0, 0], output[-6000:]
    _green_and_clean(tmp_path / "two", output)

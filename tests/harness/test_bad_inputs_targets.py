"""Bad input of check-target and interruptions: targets that slip past `parity check-target`, interruptions and
broken disks. Each row makes one mistake (a target that ends the process, hangs, leaves a thread
running, hands back None or a result of another form; a signal to a running run; a disk that
refuses rows) and names the words of the one line that must explain it, checked as
tests/harness/test_bad_inputs.py checks its table (`check_bad_input`: a non-zero exit, exactly one line
holding the words, no traceback). `test_the_checks_are_what_catch_these` switches each check off
and shows its row pass silently or lose its line.

Rows run in-process (`parity check-target`, whose check runs in a child process of its own, and
pytest sessions of the selfcheck suite) unless the process is what is tested: `parity run`'s wait
for its check, a signal to a run.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from parity.report import RESULTS_FILE, ReportWriter, read_run_info, write_run_info
from tests.support.bad_input_table import Bad, Outcome, check_bad_input, cli, process, raised
from tests.support.helpers import PROJECT_ROOT, run_parity, run_pytest_here
from tests.support.interrupt_plugin import signal_run

pytestmark = pytest.mark.parity_cpu

SLIPPERY = "tests.support.slippery_targets"

# ---------------------------------------------------------------------------------------------
# What a row does
# ---------------------------------------------------------------------------------------------


def check_target(*args: str) -> Callable[[Path], Outcome]:
    """`parity check-target ARGS` in this process (its check runs in a child process)."""
    return lambda tmp_path: cli("check-target", *args)


def module_target(name: str, source: str, *args: str) -> Callable[[Path], Outcome]:
    """`parity check-target <name>:make_target ARGS` where the module `<name>` holds `source`."""

    def run(tmp_path: Path) -> Outcome:
        (tmp_path / f"{name}.py").write_text(source)
        sys.path.insert(0, str(tmp_path))
        try:
            return cli("check-target", f"{name}:make_target", *args)
        finally:
            sys.path.remove(str(tmp_path))
            sys.modules.pop(name, None)

    return run


def resolve(spec: str) -> Callable[[Path], Outcome]:
    """What the plugin does with `--parity-target` up front (`parity.target.resolve_target`)."""
    import parity.target

    return lambda tmp_path: raised(lambda: parity.target.resolve_target(spec, option="--parity-target"))


def parity_run(*args: str, **env: str) -> Callable[[Path], Outcome]:
    """`parity run --suite selfcheck ARGS` in a fresh process: its wait for the conformance check."""

    def run(tmp_path: Path) -> Outcome:
        reports = tmp_path / "reports"
        outcome = process(run_parity(["run", "--report-dir", str(reports), "--suite", "selfcheck", *args], **env))
        if reports.is_dir() and any(reports.iterdir()):
            outcome.output += "\nleft a run directory"
        return outcome

    return run


def refusing_disk(keep: int) -> Callable[..., Any]:
    """`ReportWriter.write_many` on a disk that takes `keep` writes, then refuses every one (ENOSPC)."""
    original = ReportWriter.write_many
    written = [0]

    def write_many(writer: ReportWriter, rows: Any) -> Any:
        if written[0] >= keep:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += 1
        return original(writer, rows)

    return write_many


def full_disk(keep: int = 6) -> Callable[[Path], Outcome]:
    """The selfcheck suite, in this process, on a disk that takes `keep` rows and then refuses."""

    def run(tmp_path: Path) -> Outcome:
        args = [str(PROJECT_ROOT / "parity/suites/selfcheck"), "--parity-report-dir", str(tmp_path / "reports"), "-q"]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ReportWriter, "write_many", refusing_disk(keep))
            return Outcome(*run_pytest_here(args, basetemp=tmp_path / "basetemp"))

    return run


def incomplete_run(tmp_path: Path) -> Path:
    """A run whose run.json records rows the disk refused (what `finish_run` writes)."""
    run_dir = tmp_path / "run"
    context = {"run_id": "run", "target": "serving", "device": "cpu", "dtype": "fp32", "size": "tiny"}
    info = {
        "run_id": "run",
        "status": "incomplete",
        "reason": "3 report row(s) could not be written (OSError: [Errno 28] No space left on device)",
        "unwritten_rows": 3,
        "seed": 0,
        **{k: context[k] for k in ("device", "dtype", "size", "target")},
    }
    writer = ReportWriter(run_dir, context, on_create=lambda d: write_run_info(d, info))
    for i in range(3):
        writer.write(
            {"suite": "selfcheck", "case": f"c{i}", "metric": "max_abs", "value": 0.1, "threshold": 1.0, "verdict": "pass"}
        )
    return run_dir


def review_of(prepare: Callable[[Path], Path]) -> Callable[[Path], Outcome]:
    def run(tmp_path: Path) -> Outcome:
        run_dir = prepare(tmp_path)
        before = (run_dir / RESULTS_FILE).read_bytes()
        outcome = cli("review", run_dir, "--no-baseline")
        outcome.preserved = (run_dir / RESULTS_FILE).read_bytes() == before
        return outcome

    return run


def signalled(name: str) -> Callable[[Path], Outcome]:
    """A real `parity run --suite selfcheck` sent `name` after its fifth test; its run.json must
    record the signal (checked here: the row's line alone would not show a run.json left running)."""

    def run(tmp_path: Path) -> Outcome:
        result = signal_run(tmp_path, name)
        info = read_run_info(result.run_dir)
        assert (info.get("status"), info.get("signal")) == ("interrupted", name), json.dumps(info)
        assert "parity summary" in result.output, result.output
        return Outcome(result.code, result.output)

    return run


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

# fmt: off
BAD_TARGET_INPUTS = [
    # -- a target that ends the process, hangs or leaves threads: one line, within the time limit
    Bad("check-target-factory-sys-exit", check_target(f"{SLIPPERY}:exits"), ("the factory tests.support.slippery_targets:exits called sys.exit(0)", "a target must not end the process")),
    Bad("check-target-module-sys-exit", module_target("engine_exits", "import sys\nsys.exit(0)\n"), ("importing module 'engine_exits' called sys.exit(0)",)),
    Bad("check-target-factory-os-exit", check_target(f"{SLIPPERY}:exits_hard"), ("ended the check's process (exit code 0) in calling the factory tests.support.slippery_targets:exits_hard",)),
    Bad("check-target-factory-hangs", check_target(f"{SLIPPERY}:hangs", "--timeout", "10"), ("did not finish its check within 10 s", "it hung in calling the factory tests.support.slippery_targets:hangs"), marks=(pytest.mark.parity_slow,)),
    Bad("check-target-router-hangs", check_target(f"{SLIPPERY}:router_hangs", "--suite", "routing", "--timeout", "8"), ("did not finish its check within 8 s", "router: target.router()"), marks=(pytest.mark.parity_slow,)),
    Bad("check-target-leaves-a-thread", check_target(f"{SLIPPERY}:leaves_a_thread", "--suite", "selfcheck"), ("left 1 non-daemon thread(s) running", "'engine-loop'", "could never exit"), marks=(pytest.mark.parity_slow,)),
    Bad("check-target-router-exits", check_target(f"{SLIPPERY}:router_exits", "--suite", "routing"), ("router: target.router() called sys.exit(3)",)),
    Bad("pytest-factory-sys-exit", resolve(f"{SLIPPERY}:exits"), ("--parity-target 'tests.support.slippery_targets:exits'", "called sys.exit(0)")),
    Bad("run-target-leaves-a-thread", parity_run("--target", f"{SLIPPERY}:leaves_a_thread"), ("does not conform", "left 1 non-daemon thread(s) running"), marks=(pytest.mark.parity_slow,)),
    Bad("run-target-hangs", parity_run("--target", f"{SLIPPERY}:hangs", PARITY_CHECK_TARGET_TIMEOUT="4"), ("does not conform", "did not finish its check within 4 s"), marks=(pytest.mark.parity_slow,)),
    # -- members that return the wrong thing, checked as the suites will use it
    Bad("check-target-router-none", check_target(f"{SLIPPERY}:router_returns_none", "--suite", "routing"), ("target.router() returned None", "expected a router adapter")),
    Bad("check-target-router-dataclass", check_target(f"{SLIPPERY}:router_dataclass", "--suite", "routing"), ("must return the pair (weights, ids), plain or named", "RoutingOutput", "renormalize=True)"),),
    Bad("check-target-router-named-ids-first", check_target(f"{SLIPPERY}:router_named_ids_first", "--suite", "routing"), ("fields ('ids', 'weights')", "renormalize=True)"),),
    Bad("check-target-graph-key-not-declared", check_target(f"{SLIPPERY}:graph_key_not_declared", "--suite", "decode"), ("decode_graph_key(generating) must answer one of decode_graph_keys ('und_only', 'gen_only', 'blend')", "'both' for [False, True] (mixed)")),
    Bad("check-target-graph-select-refuses", check_target(f"{SLIPPERY}:graph_select_refuses", "--suite", "decode"), ("select_decode_graph('gen_only') raised ValueError: no gen-only graph in this build",)),
    Bad("check-target-unknown-suite", check_target("serving", "--suite", "nope"), ("--suite 'nope': no such suite", "routing")),
    Bad("check-target-timeout-zero", check_target("serving", "--timeout", "0"), ("time-out 0.0", "seconds > 0")),
    # -- interruptions and broken disks
    Bad("run-sighup", signalled("SIGHUP"), ("the run is interrupted (SIGHUP)", "summary below covers the rows written"), marks=(pytest.mark.parity_slow,)),
    Bad("session-disk-full", full_disk(), ("the run is incomplete", "report row(s) could not be written", "No space left on device"), marks=(pytest.mark.parity_slow,)),
    Bad("review-rows-not-written", review_of(incomplete_run), ("INCOMPLETE RUN", "the run was incomplete", "3 report row(s) could not be written")),
]
# fmt: on


def row(row_id: str) -> Bad:
    return next(r for r in BAD_TARGET_INPUTS if r.id == row_id)


def test_the_table_covers_both_classes() -> None:
    ids = [r.id for r in BAD_TARGET_INPUTS]
    assert len(set(ids)) == len(ids)
    assert any("check-target" in i for i in ids) and any(i.startswith(("run-sig", "session-disk")) for i in ids)


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=r.marks) for r in BAD_TARGET_INPUTS])
def test_bad_input(row: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check_bad_input(row, tmp_path, monkeypatch)

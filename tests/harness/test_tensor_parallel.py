"""Tensor-parallel runs (`parity run --tp 2`, gloo on CPU): the sharded built-in target and the
example engine's TP=2 variant through every AR suite (its quick lane), the sharding mutants killed, the run's rows
reviewed against the single-process baseline, and the ways a group breaks (a rank that dies, a
rank that hangs, a factory that cannot take `tp`, options that cannot go with it)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pandas as pd
import pytest
import torch

from parity.report import NOT_PROVIDED, mutation_score, read_results, read_run_info
from parity.report.baseline import load_rows
from parity.report.comparison import compare_rows
from parity.target import TargetError, resolve_target
from reference_models.ar.config import ar_config
from reference_models.checkpoints import random_state_dict
from serving_models.ar import sharded
from serving_models.common.safetensors_io import WeightMismatchError
from tests.support.helpers import PROJECT_ROOT, run, run_parity, run_pytest
from tests.support.shared_run import SharedRun, copy_run

pytestmark = [pytest.mark.parity_cpu]

COMMITTED_CPU_BASELINE = PROJECT_ROOT / "reports" / "baselines" / "cpu-fp32.csv"
NUMERICS_TEST = "parity/suites/ar/test_numerics.py::test_target_matches_reference_layer_by_layer"
AR_SUITES = {"expert_selection", "fail_closed_capture", "embedding_clamp", "numerics", "decode", "weight_coverage", "recompiles"}


def _gates(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["kind"] == "gate") & (frame["metric"] != NOT_PROVIDED)]


# ---------------------------------------------------------------------------------------------
# The TP=2 lane (one shared run per session, tests/support/shared_run.py)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parity_slow
def test_the_sharded_target_passes_every_ar_suite_at_tp2(tp_run: SharedRun) -> None:
    assert tp_run.returncode == 0, tp_run.stdout[-4000:]
    frame = tp_run.rows
    assert set(frame["tp"].astype(str)) == {"2"}
    gates = _gates(frame)
    assert set(gates["suite"]) >= AR_SUITES
    assert not gates["verdict"].isin(["fail", "error"]).any()
    # The families the sharded target leaves out are one not-provided row per suite, not failures.
    assert set(frame.loc[frame["metric"] == NOT_PROVIDED, "case"]) == {"dit", "routing"}
    # Every graph mode ran sharded: the CPU graph stand-in and the compiled forward captured per rank.
    routed = gates[(gates["suite"] == "expert_selection") & (gates["metric"] == "mismatched_tokens")]
    assert {"eager", "cpu_graph", "compiled"} <= set(routed["mode"])
    # Rank 1 wrote its own rows, every AR gate row with rank 0's verdict (`parity.plugin.ranks.disagreements`).
    peer = read_results(tp_run.run_dir / "ranks" / "rank-1")
    assert set(peer["tp"].astype(str)) == {"2"}
    keys = ["suite", "case", "mode", "site", "metric"]
    mine = gates[gates["suite"].isin(AR_SUITES)][[*keys, "verdict"]].sort_values(keys).reset_index(drop=True)
    theirs = _gates(peer)[_gates(peer)["suite"].isin(AR_SUITES)][[*keys, "verdict"]].sort_values(keys).reset_index(drop=True)
    pd.testing.assert_frame_equal(mine, theirs)
    assert "disagrees with rank 0" not in tp_run.stdout


@pytest.mark.parity_slow
def test_every_sharding_mutant_is_killed_at_tp2(tp_run: SharedRun) -> None:
    from parity.suites.sensitivity.catalogue import all_mutants, applies_at

    sharding = sorted(m.name for m in all_mutants().values() if applies_at(m, "cpu", 2))
    assert len(sharding) >= 5
    score = mutation_score(tp_run.rows)
    assert score is not None and score.tp == 2
    assert score.killed == score.applicable == len(sharding) and not score.survivors
    killed = tp_run.rows[(tp_run.rows["metric"] == "killed") & (tp_run.rows["verdict"] == "pass")]
    assert sorted(killed["case"]) == sharding
    # The correct sharded target raised no alarm under the control seeds, and the run says its score
    # covers the catalogue of its own size (no "DID NOT RUN" for the single-process mutants).
    controls = tp_run.rows[tp_run.rows["case"].str.startswith("correct-target-seed-") & (tp_run.rows["kind"] == "gate")]
    assert len(controls) and (controls["verdict"] == "pass").all()
    assert score.line() in tp_run.stdout and "DID NOT RUN" not in score.line()


@pytest.mark.parity_slow
def test_the_tp2_run_reviews_clean_against_the_single_process_baseline(tp_run: SharedRun, tmp_path: Path) -> None:
    """The same AR gate rows as the committed single-process baseline, none worse by the rule; the
    DiT and router rows (not provided) and the tp-1 mutants are said not compared, not vanished."""
    baseline = load_rows(COMMITTED_CPU_BASELINE)
    comparison = compare_rows(baseline, tp_run.rows, name=str(COMMITTED_CPU_BASELINE))
    assert comparison.ok, comparison.regressions.head().to_string()
    assert comparison.vanished.empty
    new = comparison.new_cases()
    assert new[new["suite"].isin(AR_SUITES) & ~new["case"].isin(["dit", "routing"])].empty, new.to_string()
    baseline_gates = _gates(baseline)
    ar_baseline_gates = baseline_gates[baseline_gates["family"] == "ar"]
    assert comparison.matched >= len(ar_baseline_gates) > 100
    assert any(why.startswith("families this target does not provide (dit, routing)") for why in comparison.not_compared)
    assert any(why.startswith("sensitivity (the mutants of tp 1") for why in comparison.not_compared)
    # `parity review` says the same, exit 0.
    result = run_parity(["review", str(copy_run(tp_run.run_dir, tmp_path / "run")), "--baseline", str(COMMITTED_CPU_BASELINE)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "regressions: 0" in result.stdout and "vanished cases: 0" in result.stdout
    assert "families this target does not provide (dit, routing)" in result.stdout


def test_without_the_family_column_every_baseline_row_is_compared(tp_run: SharedRun) -> None:
    """The exclusion reads the baseline's `family` column: with it empty the DiT rows are vanished
    again, so the exclusion is what makes the review clean."""
    baseline = load_rows(COMMITTED_CPU_BASELINE).assign(family="")
    comparison = compare_rows(baseline, tp_run.rows)
    assert not comparison.ok and comparison.vanished_gate_rows > 0
    assert set(comparison.vanished["case"]) & {"dit-blocks-32x32-text4", "dit-regional-compile"}


@pytest.mark.parity_slow
def test_the_example_engine_at_tp2_matches_its_single_process_run(
    example_tp_run: SharedRun, example_quick_run: SharedRun
) -> None:
    """The quick lane of the example engine sharded over 2 ranks and in one process: the same gate
    rows with the same verdicts, every AR suite there, compiled among the modes."""
    assert example_tp_run.returncode == 0, example_tp_run.stdout[-4000:]
    sharded_gates, single_gates = _gates(example_tp_run.rows), _gates(example_quick_run.rows)
    assert set(sharded_gates["suite"]) >= AR_SUITES and "compiled" in set(sharded_gates["mode"])
    assert set(example_tp_run.rows["tp"].astype(str)) == {"2"}
    keys = ["suite", "case", "mode", "site", "metric", "verdict"]
    assert not sharded_gates["verdict"].isin(["fail", "error"]).any()
    assert set(map(tuple, sharded_gates[keys].to_numpy().tolist())) == set(map(tuple, single_gates[keys].to_numpy().tolist()))


# ---------------------------------------------------------------------------------------------
# A broken group ends the run with the rank named, never a hang
# ---------------------------------------------------------------------------------------------


STALL_S = "20"  # the stall limit of these sessions: a broken group is named after 20 s without progress
# A generous hang guard for the child where `run` takes one (a stall-guarded `run`, docs/lanes.md §5, takes none).
LIMIT = {"timeout": 900} if "timeout" in inspect.signature(run).parameters else {}


def _tp_session(tmp_path: Path, factory: str, test: str = NUMERICS_TEST) -> tuple[int, str, Path]:
    """`pytest --parity-tp 2` (its ranks started by torch's launcher) with a failing target variant."""
    path, _, name = test.partition("::")
    args = [
        path,
        *(["-k", name] if name else []),
        "-m",
        "cpu",
        "--parity-tp",
        "2",
        "--parity-target",
        f"tests.support.tp_target_variants:{factory}",
    ]
    args += ["--parity-report-dir", str(tmp_path), "--parity-run-id", "r"]
    result = run_pytest(args, cwd=PROJECT_ROOT, **LIMIT, PARITY_STALL_S=STALL_S)
    return result.returncode, result.stdout + result.stderr, tmp_path / "r"


def _not_complete(run_dir: Path) -> None:
    """Whatever the run wrote does not claim more than happened: no run.json, or one that is not complete."""
    if (run_dir / "run.json").is_file():
        assert read_run_info(run_dir).get("status") != "complete", read_run_info(run_dir)


@pytest.mark.parity_slow
def test_a_rank_that_dies_ends_the_run_naming_it(tmp_path: Path) -> None:
    code, output, run_dir = _tp_session(tmp_path, "make_target_rank1_dies")
    assert code not in (0, 5), output[-3000:]
    assert "tensor-parallel group broken: rank 1 exited with status 7" in output, output[-3000:]
    assert f"its output: {run_dir / 'ranks' / 'rank-1.log'}" in output
    _not_complete(run_dir)


@pytest.mark.parity_slow
def test_a_rank_that_hangs_in_its_factory_is_named_by_the_heartbeat(tmp_path: Path) -> None:
    """Rank 1 never returns from its factory while rank 0 waits in its first collective: no rank
    makes progress, and after the stall limit rank 0 names where each rank is and stops both."""
    code, output, run_dir = _tp_session(tmp_path, "make_target_rank1_hangs")
    assert code == 2, output[-3000:]
    assert "tensor-parallel group broken: no rank made progress for 20 s" in output, output[-3000:]
    assert "rank 1 at calling the target's factory (tests.support.tp_target_variants:make_target_rank1_hangs)" in output
    _not_complete(run_dir)


# A rank-0 factory that hangs, and a run whose peer never finished: tests/harness/test_bad_inputs_ranks.py.


def test_a_factory_without_tp_is_refused_naming_the_contract() -> None:
    fake = dataclasses.make_dataclass("TP", ["rank", "world_size", "group"])(0, 2, None)
    with pytest.raises(TargetError, match=r"takes no 'tp' argument.*tp 2.*docs/targets.md §11"):
        resolve_target("tests.support.tp_target_variants:make_target_without_tp", tp=fake)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tp", "0"], "--tp 0: the tensor-parallel size must be at least 1"),
        (["--tp", "2", "-n", "2"], "--tp 2 with -n 2: every rank runs the same tests in the same order"),
    ],
)
def test_options_that_cannot_go_with_tp_are_refused(extra: list[str], message: str, tmp_path: Path) -> None:
    result = run_parity(["run", "--report-dir", str(tmp_path), *extra])
    assert result.returncode == 4, result.stdout + result.stderr  # a usage error (docs/cli.md §6)
    assert message in result.stderr
    assert not any(tmp_path.iterdir())  # refused before any run directory


# ---------------------------------------------------------------------------------------------
# The sharded heads' gather: a form every accepted torch compiles
# ---------------------------------------------------------------------------------------------


def _gather_probe(*flags: str) -> list[str]:
    result = run(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "tests/support/tp_gather_probe.py", *flags],
        **LIMIT,
    )
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, result.stdout[-3000:] + result.stderr[-3000:]
    return lines


@pytest.mark.parity_slow
def test_the_sharded_forward_compiles_whole_without_the_chunk_cat_torch_2_11_cannot_trace() -> None:
    """The compiled mode's case on the installed torch: the sharded forward compiles with
    fullgraph=True at TP=2 and never calls funcol's `_maybe_view_chunk_cat` (torch 2.11's Dynamo
    refuses it: the compiled rows errored there, docs/targets.md §11). The gather along the last
    dim (the broken variant, the form before) calls it on every torch."""
    assert _gather_probe() == ["rank 0: compiled ok, chunk-cat calls 0", "rank 1: compiled ok, chunk-cat calls 0"]
    old = _gather_probe("--old-form")
    assert all("compiled failed" in line or not line.endswith("chunk-cat calls 0") for line in old), old


# ---------------------------------------------------------------------------------------------
# The sharding loader checks full shapes before slicing
# ---------------------------------------------------------------------------------------------


def test_the_sharded_loader_names_a_misshapen_tensor() -> None:
    config = ar_config("tiny")
    state = random_state_dict(config, 0)
    name = "model.layers.0.self_attn.o_proj.weight"
    state[name] = state[name][:, :-1]
    with pytest.raises(WeightMismatchError, match=r"o_proj\.weight"):
        sharded.load_sharded(config, state, sharded.TensorParallel(0, 2, None))


def test_a_size_that_does_not_divide_the_heads_is_refused() -> None:
    config = ar_config("tiny")
    heads = config.num_attention_heads
    odd = next(n for n in range(2, heads + 2) if heads % n)
    with pytest.raises(
        sharded.ShardingError, match=f"num_attention_heads = {heads} is not divisible by the tensor-parallel size {odd}"
    ):
        sharded.load_sharded(config, random_state_dict(config, 0), sharded.TensorParallel(0, odd, None))


def test_each_rank_holds_its_slice_of_every_split_weight() -> None:
    config = ar_config("tiny")
    state = random_state_dict(config, 0)
    ranks = [sharded.load_sharded(config, state, sharded.TensorParallel(r, 2, None)) for r in range(2)]
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    whole = torch.cat([m.get_parameter(f"language_model.{o_proj}") for m in ranks], dim=1)
    torch.testing.assert_close(whole, state[o_proj], rtol=0, atol=0)
    embed = "model.embed_tokens.weight"
    rows = torch.cat([m.get_parameter(f"language_model.{embed}") for m in ranks], dim=0)
    torch.testing.assert_close(rows, state[embed], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Rank 0 holds every peer to its own verdicts
# ---------------------------------------------------------------------------------------------


def _verdict_rows(run_dir: Path, verdicts: dict[tuple[str, str], str]) -> Path:
    from parity.report import ReportWriter

    writer = ReportWriter(
        run_dir, {"run_id": run_dir.name, "target": "serving", "device": "cpu", "dtype": "fp32", "size": "tiny", "tp": 2}
    )
    for (suite, case), verdict in verdicts.items():
        writer.write({"suite": suite, "case": case, "metric": "max_abs", "value": 0.0, "threshold": 1.0, "verdict": verdict})
    return run_dir


def test_a_peer_that_judged_a_gate_row_otherwise_is_named(tmp_path: Path) -> None:
    """`ranks.disagreements_with`, on the verdicts each peer hands rank 0 (`ranks.gate_verdicts`):
    the same verdicts are no finding; one flipped AR verdict on rank 1 is one line naming the row
    and both verdicts; rank 0's sensitivity rows (a suite only rank 0 runs) are not expected of a peer."""
    from parity.plugin import ranks

    same = {("numerics", "mixed"): "pass", ("decode", "t2i"): "pass"}
    mine = _verdict_rows(tmp_path / "run", {**same, ("sensitivity", "tp-vocab-lookup-unmasked"): "pass"})

    def peer(verdicts: dict[tuple[str, str], str], name: str) -> dict[int, dict]:
        peer_dir = _verdict_rows(tmp_path / name, verdicts)
        return {1: {"verdicts": ranks.gate_verdicts(peer_dir), "host": "node-b", "run_dir": str(peer_dir)}}

    assert ranks.disagreements_with(mine, peer(same, "agrees")) == []
    (line,) = ranks.disagreements_with(mine, peer({**same, ("decode", "t2i"): "fail"}, "differs"))
    assert "rank 1 disagrees with rank 0 on 1 gate row(s): decode/t2i/eager max_abs: rank 0 pass, rank 1 fail" in line
    assert f"(node-b:{tmp_path / 'differs'})" in line


def test_a_run_whose_ranks_disagreed_fails_its_review(tmp_path: Path) -> None:
    """Rank 0 records the lines in run.json (`rank_disagreements`); the review's audit counts each
    as a disagreement (exit 1). Without the key the same rows review clean: the key is what fails it."""
    from parity.report import update_run_info, write_run_info

    run_dir = _verdict_rows(tmp_path / "run", {("numerics", "mixed"): "pass"})
    write_run_info(run_dir, {"run_id": "run", "status": "complete", "tp": 2, "device": "cpu", "dtype": "fp32", "size": "tiny"})
    clean = run_parity(["review", str(run_dir), "--no-baseline"])
    assert clean.returncode == 0, clean.stdout + clean.stderr
    update_run_info(run_dir, rank_disagreements=["rank 1 disagrees with rank 0 on 1 gate row(s): numerics/mixed ..."])
    result = run_parity(["review", str(run_dir), "--no-baseline"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "run.json key 'rank_disagreements': rank 1 disagrees with rank 0 on 1 gate row(s)" in result.stdout

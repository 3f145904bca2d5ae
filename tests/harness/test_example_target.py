"""The example engine target (examples/engine_target) against the AR suites, as CI runs it.

The example is written the way an engine writes its model (its own forward signature, fused-residual
layers, its own weight loader, the blend in every mode) with an adapter in front; it is the worked
example of docs/targets.md. Green on every AR suite, engine policies it does not follow recorded as
`not_applicable` with its reasons, and a planted routing bug in it caught.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from parity.report import read_results
from tests.support import shared_run
from tests.support.helpers import PROJECT_ROOT, run_pytest
from tests.support.shared_run import SharedRun

pytestmark = [pytest.mark.parity_cpu, pytest.mark.parity_slow]

EXAMPLE = shared_run.EXAMPLE.target
AR_SUITES = "parity/suites/ar"


def _run(tmp: Path, target: str, *selection: str) -> tuple[int, str, pd.DataFrame]:
    args = [*selection, "-m", "cpu", "-q", "--parity-target", target, "--parity-report-dir", str(tmp), "--parity-run-id", "r"]
    result = run_pytest(args, cwd=PROJECT_ROOT)
    return result.returncode, result.stdout + result.stderr, read_results(tmp / "r")


def test_the_example_engine_passes_every_ar_suite(example_run: SharedRun) -> None:
    """The example's run of every AR suite (`parity run --target <example>`), made once per session
    (tests/support/shared_run.py)."""
    code, output, frame = example_run.returncode, example_run.stdout, example_run.rows
    assert code == 0, output[-4000:]
    gates = frame[frame["kind"] == "gate"]
    assert set(gates["suite"]) == {
        "expert_selection",
        "fail_closed_capture",
        "embedding_clamp",
        "numerics",
        "decode",
        "weight_coverage",
        "recompiles",  # the compiled forward over a lattice of batch sizes and lengths
    }
    assert not gates["verdict"].isin(["fail", "error"]).any()
    assert set(frame["target"]) == {EXAMPLE}
    # The fused-residual layers were observed in the graph modes too, layer by layer.
    routed = gates[(gates["suite"] == "expert_selection") & (gates["metric"] == "mismatched_tokens")]
    assert {"eager", "cpu_graph", "compiled"} <= set(routed["mode"]) and (routed["verdict"] == "pass").all()


def test_declared_engine_policies_are_not_applicable_rows_with_the_reason(example_run: SharedRun) -> None:
    from examples.engine_target.parity_target import EngineTarget

    frame = example_run.rows
    na = frame[frame["verdict"] == "not_applicable"]
    for policy, reason in EngineTarget.not_applicable.items():
        rows = na[na["detail"].str.contains(f"engine policy '{policy}'", regex=False)]
        assert not rows.empty, policy
        assert rows["detail"].str.endswith(reason).all()
    # The checks behind the policies still judge what is not policy: the refusal itself, the graph
    # holding both experts, the multimodal entry's behaviour.
    judged = frame[(frame["kind"] == "gate") & (frame["verdict"] == "pass")]
    assert {"capture_refused", "gen_expert_calls", "distance_from_ids_dropped"} <= set(judged["metric"])


def test_a_planted_routing_bug_in_the_example_is_caught(tmp_path: Path) -> None:
    """`id > start` instead of `id >= start`: the first gen id is routed to the und expert."""
    code, output, frame = _run(
        tmp_path,
        "tests.support.example_target_variants:make_target_mask_past_start",
        f"{AR_SUITES}/test_expert_selection.py",
        "-k",
        "test_expert_selection and eager",
    )
    assert code == 1, output[-3000:]
    failed = frame[(frame["verdict"] == "fail") & (frame["metric"] == "mismatched_tokens")]
    assert "vocab-boundaries" in set(failed["case"])
    # "id 256: und, by the reference's weights und (want gen)": both judgements name the und expert
    assert failed["detail"].str.contains(r"id 256: und\b.*\(want gen\)", regex=True).all()


@pytest.mark.parametrize(
    ("variant", "selection", "stage", "unobservable"),
    [
        # RoPE is a function inside the engine's attention: the chain names the attention output and
        # says q and k after RoPE, between it and its within-bound inputs, could not be observed
        ("make_target_rope_theta_default", ("test_numerics.py", "layer_by_layer and eager"), "layer.0.attn", "layer.0.q_rope"),
        ("make_target_kv_slot_late", ("test_decode.py", "teacher_forced and eager"), "layer.0.attn", "layer.0.k_rope"),
        ("make_target_mask_past_start", ("test_numerics.py", "layer_by_layer and eager and vocab"), "layer.2.moe", ""),
    ],
)
def test_the_planted_bugs_are_localised_through_the_examples_stage_map(
    tmp_path: Path, variant: str, selection: tuple[str, str], stage: str, unobservable: str
) -> None:
    """The example declares its stage map (fused q|k|v and gate|up included, docs/localise.md): each
    planted bug's failing cases name the stage it sits in, and where the engine has no module for a
    stage (its RoPE is a function), the chain says so instead of guessing."""
    path, expression = selection
    code, output, frame = _run(
        tmp_path, f"tests.support.example_target_variants:{variant}", f"{AR_SUITES}/{path}", "-k", expression
    )
    assert code == 1, output[-3000:]
    blamed = frame[(frame["metric"] == "first_diverging_stage") & (frame["value"] == 1)]
    assert not blamed.empty, output[-3000:]
    assert set(blamed["site"]) == {stage}, blamed[["case", "site", "detail"]].to_string()
    if unobservable:
        assert blamed["detail"].str.contains(f"{unobservable}", regex=False).all()
        stages = frame[(frame["metric"] == "stage_rmse_vs_golden") & (frame["site"] == unobservable)]
        assert stages["detail"].str.startswith("not_observable").all() and not stages.empty


def test_decorated_adapter_methods_count_their_own_compiles(tmp_path: Path) -> None:
    """The example with `forward` under `@torch.no_grad()` and `embed` under `@torch.inference_mode()`
    (tests/support/example_target_variants.py): `torch.compile` alone compiles a method so decorated
    behind `wrap_inline`'s shared frame, and the rows read `compiles[context_decorator.<locals>.
    decorate_context]=0`, "seen: no compile". Compiled through parity's own frame, every compile count
    is the undecorated example's, under the method's name (docs/capture-and-compile.md §4)."""
    code, output, frame = _run(
        tmp_path,
        "tests.support.example_target_variants:make_target_decorated_methods",
        f"{AR_SUITES}/test_recompiles.py",
        f"{AR_SUITES}/test_embedding_clamp.py",
        "-k",
        "recompile or one_compiled_frame",
    )
    assert code == 0, output[-3000:]
    counts = frame[frame["metric"].isin(["new_compiles", "compiles[EngineARAdapter.embed]"])]
    assert set(counts["site"].fillna("")) == {"EngineARAdapter.forward", ""}, counts[["case", "site", "metric"]].to_string()
    warm_up = counts[counts["case"].str.startswith("warm-up")]
    assert len(warm_up) == 4 and (warm_up["value"] == 1).all() and (counts["verdict"] == "pass").all()
    assert "compiles[EngineARAdapter.embed]" in set(counts["metric"])


def test_greedy_columns_as_tokens_fail_only_the_dev_layout_case(tmp_path: Path) -> None:
    """A decode that returns the argmax column as the token is right in the checkpoint's own layout
    (the gen start is the text table's size) and wrong in the Dev layout: the case built for it
    (`dev-layout-crosses-into-gen`, cases/ar.toml) fails at the first gen token, every other
    decode case passes (without that case the slip passed every suite)."""
    code, output, frame = _run(
        tmp_path,
        "tests.support.example_target_variants:make_target_gen_column_as_token",
        f"{AR_SUITES}/test_decode.py",
        "-k",
        "greedy and eager",
    )
    assert code == 1, output[-3000:]
    matched = frame[frame["metric"] == "matched_steps"].set_index("case")["verdict"]
    assert matched["dev-layout-crosses-into-gen"] == "fail", matched.to_string()
    assert (matched.drop("dev-layout-crosses-into-gen") == "pass").all() and len(matched) >= 2, matched.to_string()

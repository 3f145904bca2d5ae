"""Numerics, DiT rows: the target's velocity and block outputs against the reference, and the
regionally compiled (Inductor) velocity against the eager one.

In every dtype: the golden noise-floor rule against an fp64 golden, the reference (or, for the
compiled rows, the eager target) in the run's dtype as the noise (`parity.compare.golden_noise_rule`;
`cases/dit.toml` [noise_floor] says why and what was measured).

Rows: `case` from the case file (`dit-velocity-...`, `dit-blocks-...`, `dit-compiled-...`), `site`
`velocity` or `block.<site>` (`block.context_refiner.0`, ... in execution order), `mode` eager
(serving vs reference) or compiled (compiled vs eager). Gate metric `rmse_vs_golden`, with
`max_abs`, `mean_abs`, `rel_l2`, `cosine`, `max_ulp` (against the golden) info rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from parity.compare import Verdict, diff, flag_rule, golden_noise_rule
from parity.suites.conftest import require_graph_support
from parity.suites.dit.localise import explain_compile_only, explain_forward
from parity.suites.dit.support import (
    CASES,
    BlockCase,
    DiTModels,
    VelocityCase,
    cases_for,
    compiled_for_comparison,
    forward,
    noise_floor_reason,
    record_block_outputs,
    require_size,
    velocity_inputs,
)

pytestmark = pytest.mark.parity_suite("numerics")

INFO_METRICS = ("mean_abs", "rel_l2", "cosine", "max_ulp")


def judge(
    report: Any,
    eager: torch.Tensor,
    candidate: torch.Tensor,
    golden: torch.Tensor,
    *,
    name: str,
    **where: Any,
) -> Verdict:
    """The golden noise floor of `candidate` against the fp64 `golden`, relative to `eager`'s
    error. One gate row plus the diff's info rows."""
    verdict, _ = golden_noise_rule(golden, eager, candidate, name=name, reason=noise_floor_reason(where.get("mode", "eager")))
    verdict = report.verdict(verdict, **where)
    measured = diff(golden, candidate, name=f"{name} vs fp64 golden")
    for metric in ("max_abs", *INFO_METRICS):
        report.info(metric=metric, value=getattr(measured, metric), detail=measured.name, **where)
    return verdict


def _magnitude(report: Any, tensor: torch.Tensor, **where: Any) -> None:
    """|v| of the truth beside the diff: parity of near-zero outputs would be vacuous
    (docs/model.md §6, initialisation)."""
    t = tensor.detach().double()
    rms, peak = float(t.pow(2).mean().sqrt()), float(t.abs().max())
    report.info(metric="ref_rms", value=rms, detail=f"max |ref| {peak:.4g}", **where)


@pytest.mark.parametrize("case", CASES["velocity"], ids=[c.name for c in CASES["velocity"]])
def test_velocity_matches_reference(case: VelocityCase, dit_models: DiTModels, report, settings, run_dir) -> None:
    models = dit_models
    require_size("velocity", case, models.size)
    seed = case.seed + settings.seed
    report.case, report.seed = case.name, seed  # an exception's error row names this case
    inputs = velocity_inputs(models.config, case.height, case.width, case.text_lens, case.timestep, seed)
    expected = forward(models.reference, inputs)
    got = forward(models.target, inputs)
    golden = forward(models.golden, inputs)
    where = dict(case=case.name, site="velocity", mode="eager", seed=seed)
    verdict = judge(report, expected, got, golden, name=f"velocity {tuple(got.shape)}", **where)
    _magnitude(report, golden, **where)
    if not verdict.ok:  # which stage: re-run the case with stage taps (docs/localise.md)
        explain_forward(models, inputs, "eager", report, run_dir, case=case.name)


def _block_outputs(adapter: Any, inputs: tuple[torch.Tensor, ...]) -> dict[str, list[torch.Tensor]]:
    outputs, handles = record_block_outputs(adapter)
    try:
        forward(adapter, inputs)
    finally:
        for handle in handles:
            handle.remove()
    # A block run on zero tokens (the reference's context refiner on empty text) has nothing to
    # compare; the target may skip it instead (the empty-text skip).
    return {name: [out for out in outs if out.numel()] for name, outs in outputs.items()}


@pytest.mark.parametrize("case", CASES["blocks"], ids=[c.name for c in CASES["blocks"]])
def test_blocks_match_reference(case: BlockCase, dit_models: DiTModels, report, settings, run_dir) -> None:
    models = dit_models
    require_size("blocks", case, models.size)
    seed = case.seed + settings.seed
    report.case, report.seed = case.name, seed  # an exception's error row names this case
    inputs = velocity_inputs(models.config, case.height, case.width, [case.text_len], case.timestep, seed)
    expected = _block_outputs(models.reference, inputs)
    got = _block_outputs(models.target, inputs)
    golden = _block_outputs(models.golden, inputs)
    verdicts = []
    for name, _ in models.reference.block_sites():
        where = dict(case=case.name, site=f"block.{name}", mode="eager", seed=seed)
        ref_calls, cand_calls = expected[name], got.get(name)
        if cand_calls is None or len(cand_calls) != len(ref_calls):
            found = "no such site" if cand_calls is None else f"{len(cand_calls)} non-empty calls"
            verdict = report.verdict(
                flag_rule(
                    False,
                    metric="calls",
                    value=None if cand_calls is None else len(cand_calls),
                    threshold=len(ref_calls),
                    detail=f"{name}: the reference ran it {len(ref_calls)} times on non-empty input, the target: {found}",
                ),
                **where,
            )
            verdicts.append(verdict)
            continue
        for i, (ref_out, cand_out) in enumerate(zip(ref_calls, cand_calls)):
            verdicts.append(judge(report, ref_out, cand_out, golden[name][i], name=f"{name} {tuple(cand_out.shape)}", **where))
    if not all(v.ok for v in verdicts):  # which stage inside the first diverging block (docs/localise.md)
        explain_forward(models, inputs, "eager", report, run_dir, case=case.name)


@pytest.mark.parity_compiles
def test_compiled_velocity_matches_eager(dit_models: DiTModels, report, settings, run_dir) -> None:
    """Regional compile with Inductor (fullgraph, dynamic), one compile for all cases of the size;
    eager outputs (and goldens) are taken first, on the same module. The cases share one test on
    purpose: the compiled module serves them all (one compile, as a serving engine pays it), where
    one test per case would start each from an empty Dynamo cache."""
    models = dit_models
    adapter = models.target
    require_graph_support(adapter, "compiled")
    cases = cases_for("compiled", models.size)
    assert cases, f"no [[compiled]] cases for size {models.size}"
    report.mode = "compiled"
    report.seed = settings.seed
    prepared = []
    for case in cases:
        seed = case.seed + settings.seed
        inputs = velocity_inputs(models.config, case.height, case.width, [case.text_len], case.timestep, seed)
        golden = forward(models.golden, inputs)
        prepared.append((case, seed, inputs, forward(adapter, inputs), golden))

    failing = []
    with compiled_for_comparison(report, adapter):
        for case, seed, inputs, eager, golden in prepared:
            compiled = forward(adapter, inputs)
            where = dict(case=case.name, site="velocity", mode="compiled", seed=seed)
            if not judge(report, eager, compiled, golden, name=f"compiled velocity {tuple(compiled.shape)}", **where).ok:
                failing.append((case, inputs))
    # Which stage, compiled again with stage taps, outside the counted compile (docs/localise.md).
    for case, inputs in failing:
        explain_forward(models, inputs, "compiled", report, run_dir, case=case.name)
    if failing:  # compiled against the eager target itself: a compile-only divergence, bisected once
        case, inputs = failing[0]
        explain_compile_only(models, inputs, report, case=case.name)

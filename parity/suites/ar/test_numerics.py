"""numerics (AR rows): the target against the reference, layer by layer, in every execution mode.

Per case: the hidden state after every decoder layer and the final logits, with max abs (the
gate: `rmse_vs_golden`), max abs, relative L2, cosine and ULP rows, argmax agreement on the
logits, and the first diverging layer and row in the detail. In every dtype the target is judged
against an fp64 golden with the golden noise-floor rule (`parity.suites.ar.support.judge`): its
bound is the fp32 (or bf16) reference's own error in this run, so it is as tight as the
machine's rounding, not a margin chosen for some other CPU. Pinned too: in a mixed prompt, the first
hidden row that differs from an und-only run of the same model is the first gen-vocabulary token
(the observation of vllm-project/vllm-omni#9764: routing prompt gen tokens to gen_mlp changes exactly those).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parity.compare import EXACTLY, count_rule, diff, noise_floor_multiplier
from parity.runners import make_runner
from parity.suites.ar.localise import explain_forward
from parity.suites.ar.support import PROMPTS, TOL, Prompt, ids_of, judge, moe_taps, skip_full_size_compile, vocab_gap_models
from parity.suites.conftest import require_graph_support

pytestmark = [pytest.mark.parity_suite("numerics"), pytest.mark.parity_keep_compile_cache]


@pytest.mark.parametrize("prompt", PROMPTS, ids=ids_of(PROMPTS))
def test_target_matches_reference_layer_by_layer(prompt: Prompt, mode: str, ar_models, report, run_dir) -> None:
    models = ar_models
    require_graph_support(models.target, mode)
    skip_full_size_compile(models, mode)
    report.case, report.mode = prompt.name, mode  # an exception's error row names this case
    runner = make_runner(mode, device=models.device, capture_registry=models.target.capture)
    ids = models.ids(prompt.rows)
    # expert_selection's observation taps, unused here: with the same hooks both suites share one
    # compiled forward per shape class instead of compiling it twice (docs/capture-and-compile.md §3)
    taps = moe_taps(models.target)
    with runner.prepare(models.target.forward, (ids,), dummy="zeros", taps=taps, name="forward") as run:
        got = run(ids).output
    want = models.reference_forward(ids)
    golden = models.golden_forward(ids)
    sites = [
        (f"layer.{i}", got.hidden_states[i], want.hidden_states[i], golden.hidden_states[i])
        for i in range(len(want.hidden_states))
    ]
    sites.append(("logits", got.logits, want.logits, golden.logits))
    first = None
    for site, candidate, reference, gold in sites:
        measured = diff(reference, candidate, name=site)
        verdict = judge(candidate, reference, gold, name=site)
        report.verdict(verdict, case=prompt.name, mode=mode, site=site)
        for metric in ("max_abs", "rel_l2", "cosine", "mean_abs", "max_ulp"):
            report.info(
                case=prompt.name,
                mode=mode,
                site=site,
                metric=metric,
                value=getattr(measured, metric),
                verdict=verdict.verdict,
            )
        if first is None and not verdict.ok:
            first = f"{site} row {_worst_row(reference, candidate)} (largest |d| {measured.max_abs:.3g})"
    agree = diff(want.logits, got.logits).argmax_agree
    report.info(
        case=prompt.name,
        mode=mode,
        site="logits",
        metric="argmax_agree",
        value=agree,
        detail="fraction of positions whose argmax token matches the reference's",
    )
    report.info(
        case=prompt.name,
        mode=mode,
        metric="first_divergence",
        value=0 if first is None else 1,
        detail=f"first diverging: {first}" if first else "no layer diverged beyond tolerance",
    )
    if first is not None:  # which stage inside the layer: re-run the case with stage taps (docs/localise.md)
        explain_forward(models, ids, mode, report, run_dir, case=prompt.name)


# The Dev release's vocabulary (docs/checkpoints.md §4): the text table ends before the gen ids
# start, so ids in between belong to neither table. At tiny size the gap is 16 ids.
DEV_VOCAB_GAP = 16


def test_text_table_shorter_than_gen_start(ar_models, report, target) -> None:
    """The Dev layout through `build_ar`: text ids up to the table's last row and gen ids across
    the gen table, judged layer by layer against the reference and the fp64 golden of the same
    layout. A port that counts gen rows from the text table's end (equal in Preview's layout)
    looks up the wrong gen rows here."""
    models = ar_models
    if models.size != "tiny":
        pytest.skip("the Dev vocabulary layout runs at tiny size: a 16-id gap is the same code path as Dev's 128")
    dev = vocab_gap_models(models, target, DEV_VOCAB_GAP)
    config, variant, reference, golden = dev.config, dev.target, dev.reference, dev.golden
    start, text_end, gen_end = (
        config.gen_vocab_start_index,
        config.vocab_size,
        config.gen_vocab_start_index + config.gen_vocab_size,
    )
    rows = [
        [1, text_end - 1, start, start + 1, gen_end - 1, text_end - 2, start + config.gen_vocab_size // 2, 7],
        [start + 3, 5, gen_end - 2, text_end - 3, start + config.gen_vocab_size // 2 + 1, 2, start, text_end - 1],
    ]
    ids = torch.tensor(rows, dtype=torch.long, device=models.device)
    got, want, gold = variant.forward(ids), reference.forward(ids), golden.forward(ids)
    sites = [
        (f"layer.{i}", got.hidden_states[i], want.hidden_states[i], gold.hidden_states[i]) for i in range(len(want.hidden_states))
    ]
    for site, candidate, ref, truth in [*sites, ("logits", got.logits, want.logits, gold.logits)]:
        verdict = judge(candidate, ref, truth, name=site)
        layout = f"text table {text_end} rows, gen ids from {start}"
        report.verdict(
            dataclasses.replace(verdict, detail=f"{layout}: {verdict.detail}"), case="dev-vocab-gap", mode="eager", site=site
        )


def _worst_row(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[int, ...]:
    """The (batch, position) of the hidden row or logits row with the largest |candidate - reference|."""
    per_row = (candidate.double() - reference.double()).abs().nan_to_num(nan=float("inf")).amax(-1)
    return tuple(int(i) for i in torch.unravel_index(per_row.argmax(), per_row.shape))


def _first_row_above_noise(a: torch.Tensor, b: torch.Tensor, reference: torch.Tensor, golden: torch.Tensor) -> list[int | None]:
    """Half precision: per batch row, the first position whose hidden vectors in `a` and `b` are
    further apart (RMSE over the hidden size) than the noise-floor multiplier times the reference's
    own distance from the fp64 golden at that position, plus the golden's rounding to the dtype.
    A fixed bound does not serve: on the H200 the eager split's gathered GEMMs round the und rows
    differently from an und-only run by whole bf16 spacings, compounding over the layers, while
    the other expert moves a row by many times the reference's own rounding error."""
    dtype = a.dtype
    multiplier = noise_floor_multiplier(dtype, a.shape[-1])

    def rms(x: torch.Tensor) -> torch.Tensor:  # per (batch, position) row
        return x.double().pow(2).mean(-1).sqrt()

    floor = rms(golden.double() - golden.to(dtype).double())
    bound = multiplier * rms(reference.double() - golden.double()) + floor
    differs = rms(a.double() - b.double()) > bound
    return [int(row.nonzero()[0]) if bool(row.any()) else None for row in differs]


def _first_differing_position(a: torch.Tensor, b: torch.Tensor, tol) -> list[int | None]:
    """Per batch row: the first position whose hidden vector differs beyond `tol` (the eager split
    runs each expert on a gathered subset of rows, so und rows carry GEMM-shape rounding)."""
    differs = ((a - b).abs() > tol.atol + tol.rtol * b.abs()).any(-1)
    return [int(row.nonzero()[0]) if bool(row.any()) else None for row in differs]


@pytest.mark.parametrize("prompt", PROMPTS, ids=ids_of(PROMPTS))
def test_first_differing_row_is_the_first_gen_token(prompt: Prompt, ar_models, report) -> None:
    """Against an und-only run of the same model (embeddings without a mask: every token on the
    und expert), the first hidden row that changes is the first gen-vocabulary token."""
    models = ar_models
    ids = models.ids(prompt.rows)
    gen = ids >= models.start
    mixed_rows = [b for b in range(ids.shape[0]) if bool(gen[b].any()) and not bool(gen[b].all())]
    if not mixed_rows:
        pytest.skip(f"{prompt.name}: no batch row mixes und and gen tokens, so no row is the first gen token")
    routed_states = models.target.forward(ids).hidden_states
    routed = routed_states[-1]
    und_only = models.target.forward(None, models.target.embed(ids)).hidden_states[-1]
    if models.dtype == torch.float32:
        observed = _first_differing_position(routed, und_only, TOL["graph_vs_eager_fp32"])
    else:
        reference, golden = models.reference_forward(ids).hidden_states[-1], models.golden_forward(ids).hidden_states[-1]
        observed = _first_row_above_noise(routed, und_only, reference, golden)
    for b in mixed_rows:
        expected = int(gen[b].nonzero()[0])
        position = -1 if observed[b] is None else observed[b]
        report.verdict(
            count_rule(
                position,
                expected,
                metric="first_differing_position",
                at=EXACTLY,
                detail=f"row {b}: first gen token at {expected} (id {int(ids[b, expected])}), first differing hidden row {observed[b]}",
            ),
            case=prompt.name,
            site=f"layer.{len(routed_states) - 1}",
        )

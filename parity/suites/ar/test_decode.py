"""decode: greedy generation, the target's prefill + KV-cache decode against reference recompute.

The decode step runs eager and graph-replayed (captured once on an all-zero dummy batch, as a
serving engine captures it). Two metrics (`parity/suites/ar/decode.py`):

* free-running greedy (`test_greedy_decode_matches_reference`): token sequences must match the
  reference's; per-step logits within tolerance up to the first divergence. A differing token
  whose reference top-1 minus top-2 logit lies within the dtype's noise is a `tie_flip` (margin
  recorded); after it the sequences legitimately diverge, so this metric stops there.
* teacher-forced (`test_teacher_forced_decode_matches_reference`): the target is fed the
  reference's token at every step, so every step's logits are compared whatever the tokens did
  (rows per bucket of steps, and `compared_steps`, which must equal the case's steps). In bf16 a
  tie flip at step 2-8 is common; this metric still judges the remaining steps.

For the review page's decode view, info rows beside the gates: `tokens` (site `reference` and
`target`: the free-running sequences, as ids in the row's data) and `step_max_abs` (site
`teacher_forced`: the step logits' largest difference per step, in the row's data).

One prompt's decode must cross from und into gen tokens, so decode routing keeps following token
ids (the mask is re-derived every step).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from parity.compare import FAIL, PASS, TIE_FLIP, flag_rule
from parity.suites.ar.decode import (
    ReferenceDecode,
    first_step_above_noise,
    graph_step,
    judge_free_running,
    judge_teacher_forced,
    reference_decode,
    step_errors,
    step_errors_text,
    teacher_forced_step_logits,
    token_text,
    write_teacher_forced,
)
from parity.suites.ar.localise import explain_decode
from parity.suites.ar.support import CASES, ARModels, DecodeCase, ids_of, vocab_gap_models
from parity.suites.conftest import require_graph_support

pytestmark = pytest.mark.parity_suite("decode")

DECODE = CASES["decode"]
MODES = ["eager", "cpu_graph", "cuda_graph"]


@pytest.fixture(scope="module")
def reference_decodes() -> Iterator[dict[str, tuple[weakref.ref, ReferenceDecode]]]:
    """The reference's greedy decode (and golden) per case, shared by both metrics and all modes
    of this module; it does not keep the models alive (only a weak reference to check identity)."""
    cache: dict[str, tuple[weakref.ref, ReferenceDecode]] = {}
    yield cache
    cache.clear()


@pytest.fixture(scope="module")
def layout_models() -> Iterator[dict[int, tuple[weakref.ref, ARModels]]]:
    """The models of the cases in the Dev vocabulary layout (`vocab_gap`), per gap, built once for
    both metrics and all modes of this module (a weak reference to the session's models tells a
    stale entry)."""
    cache: dict[int, tuple[weakref.ref, ARModels]] = {}
    yield cache
    cache.clear()


def _case_models(cache: dict, models: ARModels, target: Any, case: DecodeCase) -> ARModels:
    """The session's models, or for a case with a `vocab_gap` the same models rebuilt in the Dev
    layout (docs/checkpoints.md §4), where greedy decoding must map the argmax column to its token."""
    if not case.vocab_gap:
        return models
    if models.size != "tiny":
        pytest.skip(f"the Dev vocabulary layout runs at tiny size: a {case.vocab_gap}-id gap is the same code path as Dev's 128")
    hit = cache.get(case.vocab_gap)
    if hit is None or hit[0]() is not models:
        hit = (weakref.ref(models), vocab_gap_models(models, target, case.vocab_gap))
        cache[case.vocab_gap] = hit
    return hit[1]


def _reference(cache: dict, models: ARModels, case: DecodeCase) -> ReferenceDecode:
    hit = cache.get(case.name)
    if hit is None or hit[0]() is not models:
        hit = (weakref.ref(models), reference_decode(models, models.ids(case.prompt), case.steps))
        cache[case.name] = hit
    return hit[1]


def _require_mode(models: ARModels, mode: str, device) -> None:
    if mode == "cuda_graph" and device.type != "cuda":
        pytest.skip("cuda_graph needs --device cuda")
    if mode == "cpu_graph" and device.type != "cpu":
        pytest.skip("cpu_graph is the CPU lane's stand-in")
    require_graph_support(models.target, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", DECODE, ids=ids_of(DECODE))
def test_greedy_decode_matches_reference(
    case, mode: str, ar_models, target, report, device, reference_decodes, layout_models, run_dir
) -> None:
    models = _case_models(layout_models, ar_models, target, case)
    _require_mode(models, mode, device)
    reference = _reference(reference_decodes, models, case)
    prompt = reference.prompt
    batch, length = prompt.shape
    if mode == "eager":
        got = models.target.greedy_generate(prompt, case.steps)
    else:
        models.target.allocate_decode_state(batch, length + case.steps)
        run, step = graph_step(models, mode, batch)
        with run:
            got = models.target.greedy_generate(prompt, case.steps, step_fn=step)

    judged = judge_free_running(models, reference, got.tokens, got.step_logits)
    report.verdict(judged.matched, case=case.name, mode=mode)
    for side, sequence in (("reference", reference.tokens), ("target", got.tokens)):  # the page shows both
        report.info(
            case=case.name,
            mode=mode,
            site=side,
            metric="tokens",
            value=int(sequence.shape[1]),
            verdict=judged.matched.verdict,
            detail=token_text(sequence),
            data={"tokens": sequence.tolist()},
        )
    if judged.logits is not None:
        report.verdict(judged.logits, case=case.name, mode=mode, site=judged.site)
        for metric in ("max_abs", "max_ulp"):
            report.info(
                case=case.name,
                mode=mode,
                site=judged.site,
                metric=metric,
                value=getattr(judged.measured, metric),
                verdict=judged.logits.verdict,
                detail=judged.measured.name,
            )

    if not judged.matched.ok or (judged.logits is not None and not judged.logits.ok):
        # the contexts agree up to and including the first differing token's step: localise the first
        # step above the noise floor there (docs/localise.md)
        agreed = min(int(judged.matched.value) + 1, int(got.step_logits.shape[1]))
        first = first_step_above_noise(reference, got.step_logits[:, :agreed])
        if first is not None:
            explain_decode(models, prompt, reference.tokens, first, mode, report, run_dir, case=case.name)

    generated = reference.tokens
    gen_tokens = int((generated >= models.start).sum())
    und_tokens = int((generated < models.start).sum())
    crossing = gen_tokens > 0 and und_tokens > 0
    detail = f"the reference generated {und_tokens} und and {gen_tokens} gen tokens"
    if case.require_crossing:
        report.verdict(
            flag_rule(
                crossing,
                metric="crosses_into_gen_tokens",
                detail=detail + " (the case must cross, or it does not test decode routing)",
            ),
            case=case.name,
            mode=mode,
        )
    else:
        report.info(case=case.name, mode=mode, metric="gen_tokens_generated", value=gen_tokens, detail=detail)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", DECODE, ids=ids_of(DECODE))
def test_teacher_forced_decode_matches_reference(
    case, mode: str, ar_models, target, report, device, reference_decodes, layout_models, run_dir
) -> None:
    models = _case_models(layout_models, ar_models, target, case)
    _require_mode(models, mode, device)
    reference = _reference(reference_decodes, models, case)
    prompt = reference.prompt
    batch, length = prompt.shape
    if mode == "eager":
        logits = teacher_forced_step_logits(models.target, prompt, reference.tokens)
    else:
        models.target.allocate_decode_state(batch, length + case.steps)
        run, step = graph_step(models, mode, batch)
        with run:
            logits = teacher_forced_step_logits(models.target, prompt, reference.tokens, step_fn=step)
    forced = judge_teacher_forced(models, reference, logits)
    write_teacher_forced(report, forced, case=case.name, mode=mode)
    first = first_step_above_noise(reference, logits) if not all(b.verdict.ok for b in forced.buckets) else None
    if first is not None:  # which stage of that step's computation: re-run it with stage taps (docs/localise.md)
        explain_decode(models, prompt, reference.tokens, first, mode, report, run_dir, case=case.name)
    errors = step_errors(reference.step_logits, logits)  # per step, for the page's plot (the gate rows are per bucket)
    if errors:
        bucket_verdicts = {bucket.verdict.verdict for bucket in forced.buckets}
        report.info(
            case=case.name,
            mode=mode,
            site="teacher_forced",
            metric="step_max_abs",
            value=max(errors),
            verdict=next((v for v in (FAIL, TIE_FLIP) if v in bucket_verdicts), PASS),
            detail=step_errors_text(errors),
            data={"steps": errors},
        )

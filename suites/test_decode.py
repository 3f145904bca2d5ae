"""decode: greedy generation, the target's prefill + KV-cache decode against reference recompute.

The decode step runs eager and graph-replayed (captured once on an all-zero dummy batch, as a
serving engine captures it). Token sequences must match the reference's; per-step logits within
tolerance up to the first divergence. A differing token whose reference top-1 minus top-2 logit
lies within the dtype's noise is a `tie_flip` (margin recorded); after it the sequences
legitimately diverge, so the comparison stops there. One prompt's decode must cross from und
into gen tokens, so decode routing keeps following token ids (the mask is re-derived every step).
"""

from __future__ import annotations

import pytest
import torch

from parity.compare import FAIL, PASS, TIE_FLIP, Verdict, classify_decision, diff, noise_floor_rule
from parity.runners import make_runner
from suites.ar_support import CASES, TOL, ids_of
from suites.conftest import require_graph_support

pytestmark = pytest.mark.suite("decode")

DECODE = CASES["decode"]
SETTINGS = CASES["decode_settings"]


def _graph_step(models, mode: str, batch: int):
    """Capture the target's decode step on all-zero ids and positions; return a replaying step."""
    runner = make_runner(mode, device=models.device, capture_registry=models.target.capture)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=models.device)
    positions = torch.zeros(batch, dtype=torch.long, device=models.device)
    run = runner.prepare(models.target.decode_step, (ids, positions), dummy="zeros", name="decode_step")
    return run, lambda step_ids, step_positions: run(step_ids, step_positions).output


def _first_divergence(want: torch.Tensor, got: torch.Tensor) -> int | None:
    differs = (want != got).any(0)
    return int(differs.nonzero()[0]) if bool(differs.any()) else None


def _tie_verdict(models, want_logits: torch.Tensor, want: torch.Tensor, got: torch.Tensor, step: int) -> tuple[str, str]:
    """Classify the first differing step by the reference's top-1 vs top-2 margin at that step."""
    details, verdicts = [], []
    for row in range(want.shape[0]):
        if want[row, step] == got[row, step]:
            continue
        top2 = want_logits[row, step].double().topk(2)
        margin = float(top2.values[0] - top2.values[1])
        magnitude = float(top2.values[0].abs())
        verdict = classify_decision(margin, magnitude, models.dtype, SETTINGS.tie_spacings)
        verdicts.append(verdict)
        details.append(
            f"row {row} step {step}: reference {int(want[row, step])} vs target {int(got[row, step])}, "
            f"top-2 margin {margin:.3g} at |logit| {magnitude:.3g} ({verdict})"
        )
    worst = FAIL if FAIL in verdicts else TIE_FLIP
    return worst, "; ".join(details) + f" [{SETTINGS.reason}]"


@pytest.mark.parametrize("mode", ["eager", "cpu_graph", "cuda_graph"])
@pytest.mark.parametrize("case", DECODE, ids=ids_of(DECODE))
def test_greedy_decode_matches_reference(case, mode: str, ar_models, report, device) -> None:
    models = ar_models
    if mode == "cuda_graph" and device.type != "cuda":
        pytest.skip("cuda_graph needs --device cuda")
    if mode == "cpu_graph" and device.type != "cpu":
        pytest.skip("cpu_graph is the CPU lane's stand-in")
    require_graph_support(models.target, mode)
    prompt = models.ids(case.prompt)
    batch, length = prompt.shape
    reference = models.reference.greedy_generate(prompt, case.steps)
    if mode == "eager":
        got = models.target.greedy_generate(prompt, case.steps)
    else:
        models.target.allocate_decode_state(batch, length + case.steps)
        run, step = _graph_step(models, mode, batch)
        with run:
            got = models.target.greedy_generate(prompt, case.steps, step_fn=step)

    diverged = _first_divergence(reference.tokens, got.tokens)
    matched = case.steps if diverged is None else diverged
    if diverged is None:
        verdict, detail = PASS, f"all {case.steps} greedy tokens of {batch} row(s) equal the reference's"
    else:
        verdict, detail = _tie_verdict(models, reference.step_logits, reference.tokens, got.tokens, diverged)
    report.verdict(Verdict(verdict, "matched_steps", matched, case.steps, detail), case=case.name, mode=mode, better="higher")

    compared = slice(0, matched if diverged is not None else case.steps)
    if compared.stop > 0:
        want, have = reference.step_logits[:, compared], got.step_logits[:, compared]
        if models.golden is None:  # fp32: plain tolerance
            measured = diff(want, have, TOL["serving_vs_reference_fp32"], name="step logits")
            step = None if measured.first_bad_index is None else measured.first_bad_index[1]
            report.diff(measured, case=case.name, mode=mode, site="step_logits" if step is None else f"step.{step}")
        else:  # off fp32: both against the fp64 golden, teacher-forced on the reference's tokens
            sequence = torch.cat([prompt, reference.tokens], dim=1)
            golden = models.golden.forward(sequence).logits[:, length - 1 : length - 1 + case.steps][:, compared]
            verdict, _ = noise_floor_rule(golden, want, have, TOL["noise_floor_bf16"], name="step logits")
            report.verdict(verdict, case=case.name, mode=mode, site="step_logits")

    generated = reference.tokens
    gen_tokens = int((generated >= models.start).sum())
    und_tokens = int((generated < models.start).sum())
    crossing = gen_tokens > 0 and und_tokens > 0
    detail = f"the reference generated {und_tokens} und and {gen_tokens} gen tokens"
    if case.require_crossing:
        report.verdict(Verdict(PASS if crossing else FAIL, "crosses_into_gen_tokens", int(crossing), 1,
                               detail + " (the case must cross, or it does not test decode routing)"),
                       case=case.name, mode=mode, better="equal")
    else:
        report.info(case=case.name, mode=mode, metric="gen_tokens_generated", value=gen_tokens, detail=detail)

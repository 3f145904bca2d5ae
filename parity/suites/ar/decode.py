"""The decode suite's two metrics, as functions the suite and its tests (tests/) both call.

* **Free-running greedy** (`judge_free_running`): each side feeds back its own argmax. Tokens must
  equal the reference's; step logits are compared up to the first differing token. A differing
  token whose reference top-1 minus top-2 logit lies within the dtype's noise is a `tie_flip`;
  after it the sequences legitimately diverge, so this metric stops there.
* **Teacher-forced** (`teacher_forced_step_logits`, `judge_teacher_forced`): the target is
  prefilled with the prompt and then fed the *reference's* token at every step, so its step logits
  are those of the same context as the reference's (the reference's greedy step logits are already
  conditioned on its own tokens) and every step is compared, tie flip or not. Rows per bucket of
  steps (`[decode_settings] bucket_steps`).

Step logits are judged in every dtype by the golden noise-floor rule (`judge` of
`parity.suites.ar.support`, cases/ar.toml [noise_floor]): the golden is the fp64 reference's
forward over prompt + the reference's tokens (the same context both sides were fed), and the bound
is the reference's own error in the run's dtype, measured in the same run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from parity.compare import (
    EXACTLY,
    FAIL,
    PASS,
    TIE_FLIP,
    TensorDiff,
    Verdict,
    better_of,
    classify_decision,
    count_rule,
    diff,
    with_rule,
)
from parity.contract import requirement
from parity.runners import make_runner
from parity.suites.ar.support import CASES, ARModels, DecodeSettings, judge
from parity.target import TargetError

SETTINGS: DecodeSettings = CASES["decode_settings"]

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ReferenceDecode:
    """The reference's greedy decode of one prompt and the golden's logits on its tokens."""

    prompt: torch.Tensor  # [B, L]
    tokens: torch.Tensor  # [B, N]: the reference's greedy tokens
    step_logits: torch.Tensor  # [B, N, V]: step_logits[:, i] chose tokens[:, i]
    golden: torch.Tensor  # [B, N, V] fp64, same contexts as step_logits

    @property
    def steps(self) -> int:
        return int(self.tokens.shape[1])


@torch.no_grad()
def reference_decode(models: ARModels, prompt: torch.Tensor, steps: int) -> ReferenceDecode:
    """Run the reference's greedy decode (full recompute) and the fp64 golden on its tokens."""
    out = models.reference.greedy_generate(prompt, steps)
    length = prompt.shape[1]
    sequence = torch.cat([prompt, out.tokens], dim=1)
    golden = models.golden_forward(sequence).logits[:, length - 1 : length - 1 + steps]
    return ReferenceDecode(prompt, out.tokens, out.step_logits, golden)


class DecodeGraphs:
    """The target's decode step prepared in a mode once per decode graph the target declares.

    A serving target with mask-keyed decode graphs (`decode_graph_keys`, docs/model.md §4) gets
    one graph per key, each recorded on all-zero ids and positions (as a serving engine captures,
    before any prefill) with the key selected by the runner's `host_prepare` hook, so the capture
    bakes it; a target without keys gets one graph. Each call replays the graph the target picks
    (`decode_graph_key`) from the batch's host-side composition: per row, whether the request may
    feed a gen token this step. The target's decode state must already be allocated (the graphs
    are bound to its buffers). A context manager: closing restores the target's default graph.
    """

    def __init__(self, models: ARModels, mode: str, batch: int, *, taps: dict | None = None) -> None:
        target = models.target
        self.target, self.start = target, models.start
        self.keys: tuple[str | None, ...] = tuple(getattr(target, "decode_graph_keys", None) or (None,))
        self.replays: dict[str | None, int] = dict.fromkeys(self.keys, 0)
        self.runs: dict[str | None, Any] = {}
        runner = make_runner(mode, device=models.device, capture_registry=target.capture)
        ids = torch.zeros(batch, 1, dtype=torch.long, device=models.device)
        positions = torch.zeros(batch, dtype=torch.long, device=models.device)
        try:
            for key in self.keys:
                select = None if key is None else (lambda *_inputs, key=key: target.select_decode_graph(key))
                name = "decode_step" if key is None else f"decode_step[{key}]"
                self.runs[key] = runner.prepare(
                    target.decode_step, (ids, positions), dummy="zeros", taps=taps, name=name, host_prepare=select
                )
        except BaseException:
            self.close()
            raise

    @property
    def keyed(self) -> bool:
        return self.keys != (None,)

    def key_for(self, generating: Sequence[bool | None]) -> str | None:
        """The target's pick for a batch whose rows are (True) or are not generating; a pick that is
        no declared key is the target's error, named (docs/targets.md §3.2)."""
        if not self.keyed:
            return None
        key = self.target.decode_graph_key(list(generating))
        if not (isinstance(key, str) and key in self.keys):
            keys = requirement("decode_graph_keys")
            raise TargetError(
                f"the {self.target.name} target's decode_graph_key({list(generating)}) returned {key!r}: expected one of "
                f"its {keys.words} {self.keys} ({keys.cite}; parity check-target asks it too)"
            )
        return key

    def run(self, ids: torch.Tensor, positions: torch.Tensor, generating: Sequence[bool | None] | None = None) -> Any:
        """Replay the graph for this batch; `generating` is the host's per-row state. Without it the
        harness plays a synchronous engine, which holds the tokens it sampled (and feeds) on the
        host: they are read here, outside any graph."""
        if generating is None:
            generating = (ids[:, -1] >= self.start).tolist() if self.keyed else []
        key = self.key_for(generating)
        self.replays[key] += 1
        return self.runs[key](ids, positions)

    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.run(ids, positions).output

    def close(self) -> None:
        for run in self.runs.values():
            run.close()
        if self.keyed:
            self.target.select_decode_graph(None)

    def __enter__(self) -> DecodeGraphs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def graph_step(models: ARModels, mode: str, batch: int) -> tuple[DecodeGraphs, StepFn]:
    """Capture the target's decode graphs on all-zero ids and positions (as a serving engine
    captures them, before any prefill); return them (a context manager) and a replaying step.
    The target's decode state must already be allocated: the graphs are bound to its buffers."""
    graphs = DecodeGraphs(models, mode, batch)
    return graphs, graphs.step


# ---------------------------------------------------------------------------------------------
# Free-running greedy decode (tie-aware up to the first divergence)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FreeRunning:
    """The free-running metric: `matched` (gate `matched_steps`) and the step logits up to the
    first divergence (`logits`, the golden noise floor, and `measured`, the plain diff recorded
    beside it), None when no step was comparable."""

    matched: Verdict
    logits: Verdict | None
    measured: TensorDiff | None
    site: str


def first_divergence(want: torch.Tensor, got: torch.Tensor) -> int | None:
    """The first step at which any row's token differs, or None."""
    differs = (want != got).any(0)
    return int(differs.nonzero()[0]) if bool(differs.any()) else None


def tie_verdict(
    dtype: torch.dtype,
    want_logits: torch.Tensor,
    want: torch.Tensor,
    got: torch.Tensor,
    step: int,
    golden: torch.Tensor | None = None,
    got_logits: torch.Tensor | None = None,
) -> tuple[str, str]:
    """Classify the first differing step by the reference's top-1 vs top-2 margin at that step.

    With the golden's and the target's logits at that step (same context: the tokens agree before
    it), the margin is also held against noise measured there: the reference's and the target's
    largest distance from the golden, summed. That holds only while the target's logits at the
    step pass the golden noise floor themselves, so a defect cannot widen its own allowance."""
    details, verdicts = [], []
    for row in range(want.shape[0]):
        if want[row, step] == got[row, step]:
            continue
        top2 = want_logits[row, step].double().topk(2)
        margin = float(top2.values[0] - top2.values[1])
        magnitude = float(top2.values[0].abs())
        measured, noise_text = 0.0, ""
        if golden is not None and got_logits is not None:
            exact = golden[row, step].double()
            ref_dev = float((want_logits[row, step].double() - exact).abs().max())
            tgt_dev = float((got_logits[row, step].double() - exact).abs().max())
            in_noise = judge(got_logits[row, step], want_logits[row, step], golden[row, step], name=f"row {row} step {step}")
            measured = ref_dev + tgt_dev if in_noise.ok else 0.0
            noise_text = f", measured noise {ref_dev:.3g} (reference) + {tgt_dev:.3g} (target) from the golden" + (
                "" if in_noise.ok else f" not counted: the target's step logits are above the noise floor ({in_noise.detail})"
            )
        verdict = classify_decision(margin, magnitude, dtype, SETTINGS.tie_spacings, measured)
        verdicts.append(verdict)
        details.append(
            f"row {row} step {step}: reference {int(want[row, step])} vs target {int(got[row, step])}, "
            f"top-2 margin {margin:.3g} at |logit| {magnitude:.3g}{noise_text} ({verdict})"
        )
    worst = FAIL if FAIL in verdicts else TIE_FLIP
    return worst, with_rule("; ".join(details), SETTINGS.reason)


def judge_free_running(
    models: ARModels, reference: ReferenceDecode, tokens: torch.Tensor, step_logits: torch.Tensor
) -> FreeRunning:
    """Tokens against the reference's; step logits up to the first differing token."""
    steps, batch = reference.steps, reference.tokens.shape[0]
    diverged = first_divergence(reference.tokens, tokens)
    matched = steps if diverged is None else diverged
    rule = ""  # a divergence is judged by the decode settings' tie rule, whose reason ends the detail
    if diverged is None:
        verdict, detail = PASS, f"all {steps} greedy tokens of {batch} row(s) equal the reference's"
    else:
        verdict, detail = tie_verdict(
            models.dtype, reference.step_logits, reference.tokens, tokens, diverged, reference.golden, step_logits
        )
        rule = SETTINGS.reason
    matched_verdict = Verdict(verdict, "matched_steps", matched, steps, detail, better=better_of("matched_steps"), rule=rule)

    if matched == 0:
        return FreeRunning(matched_verdict, None, None, "step_logits")
    want, have = reference.step_logits[:, :matched], step_logits[:, :matched]
    worst, worst_abs = _worst_step(want, have, 0)
    name = f"step logits, steps 0-{matched - 1} (largest |d| {worst_abs:.3g} at step {worst})"
    logits = judge(have, want, reference.golden[:, :matched], name=name)
    return FreeRunning(matched_verdict, logits, diff(want, have, name=name), "step_logits")


# ---------------------------------------------------------------------------------------------
# Teacher-forced decode (every step compared)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def teacher_forced_step_logits(
    target: Any, prompt: torch.Tensor, tokens: torch.Tensor, step_fn: StepFn | None = None
) -> torch.Tensor:
    """The target's step logits when fed `tokens` (the reference's) instead of its own argmax.

    Through the adapter contract only: `prefill(prompt)` gives step 0, then step `i` is
    `decode_step(tokens[:, i-1], position L+i-1)` (or `step_fn`, a replayed graph of it). Returns
    [B, N, V], index i conditioned on prompt + tokens[:, :i], like the reference's step logits.
    Without `step_fn` the decode state is allocated here; with one it must already be (the graph
    is bound to that state's buffers).
    """
    batch, length = prompt.shape
    steps = tokens.shape[1]
    if steps < 1:
        raise ValueError("teacher-forced decode needs at least one step")
    if step_fn is None:
        target.allocate_decode_state(batch, length + steps)
    step = step_fn or target.decode_step
    logits = [target.prefill(prompt)[:, -1]]
    for i in range(1, steps):
        positions = torch.full((batch,), length + i - 1, dtype=torch.long, device=prompt.device)
        logits.append(step(tokens[:, i - 1 : i], positions))
    return torch.stack(logits, dim=1)


@dataclasses.dataclass(frozen=True)
class StepBucket:
    """One bucket of teacher-forced steps [first, last]: its gate verdict and the plain diff
    (max abs, max ULP in the candidate's dtype) recorded beside it."""

    first: int
    last: int
    verdict: Verdict  # the golden noise floor (`rmse_vs_golden`)
    measured: TensorDiff

    @property
    def site(self) -> str:
        return f"teacher_forced.steps.{self.first}-{self.last}"


@dataclasses.dataclass(frozen=True)
class TeacherForced:
    buckets: list[StepBucket]
    compared: Verdict  # gate `compared_steps`: the steps judged, must equal the case's steps


def _worst_step(want: torch.Tensor, have: torch.Tensor, first: int) -> tuple[int, float]:
    """The step (absolute index) with the largest |have - want| in a bucket, and that value."""
    per_step = (have.double() - want.double()).abs().nan_to_num(nan=float("inf")).amax(dim=(0, 2))
    worst = int(per_step.argmax())
    return first + worst, float(per_step[worst])


def _first_step_above_noise(want: torch.Tensor, have: torch.Tensor, golden: torch.Tensor) -> int | None:
    """The first step (index into the bucket) whose logits alone fail the golden noise floor."""
    for step in range(want.shape[1]):
        if not judge(have[:, step], want[:, step], golden[:, step], name=f"step {step}").ok:
            return step
    return None


def first_step_above_noise(reference: ReferenceDecode, step_logits: torch.Tensor) -> int | None:
    """The first teacher-forced step whose logits alone fail the golden noise floor (None: none)."""
    steps = min(reference.steps, int(step_logits.shape[1]))
    return _first_step_above_noise(reference.step_logits[:, :steps], step_logits[:, :steps], reference.golden[:, :steps])


def judge_teacher_forced(
    models: ARModels, reference: ReferenceDecode, step_logits: torch.Tensor, bucket_steps: int | None = None
) -> TeacherForced:
    """Judge the target's teacher-forced step logits against the reference's, bucket by bucket."""
    bucket_steps = bucket_steps or SETTINGS.bucket_steps
    steps = reference.steps
    have_steps = int(step_logits.shape[1])
    compared = min(steps, have_steps)
    buckets = []
    for first in range(0, compared, bucket_steps):
        last = min(first + bucket_steps, compared) - 1
        want, have = reference.step_logits[:, first : last + 1], step_logits[:, first : last + 1]
        worst, worst_abs = _worst_step(want, have, first)
        name = f"teacher-forced step logits, steps {first}-{last} (largest |d| {worst_abs:.3g} at step {worst})"
        golden = reference.golden[:, first : last + 1]
        verdict = judge(have, want, golden, name=name)
        if not verdict.ok:  # name the first step that is above the noise floor on its own
            step = _first_step_above_noise(want, have, golden)
            if step is not None:
                name += f", first step above the noise floor at step {first + step}"
                verdict = judge(have, want, golden, name=name)
        measured = diff(want, have, name=name)
        buckets.append(StepBucket(first, last, verdict, measured))
    detail = f"{compared} of {steps} decode steps compared teacher-forced (the target fed the reference's tokens)"
    if have_steps != steps:
        detail += f"; the target produced {have_steps} step logits"
    count = count_rule(compared, steps, metric="compared_steps", at=EXACTLY, detail=detail)
    return TeacherForced(buckets, count)


def write_teacher_forced(report: Any, result: TeacherForced, *, case: str, mode: str) -> None:
    """Rows: per bucket a gate row `rmse_vs_golden` with `max_abs` and `max_ulp` as info rows;
    then the gate row `compared_steps`."""
    for bucket in result.buckets:
        where = {"case": case, "mode": mode, "site": bucket.site}
        report.verdict(bucket.verdict, **where)
        for metric in ("max_abs", "max_ulp"):
            report.info(
                metric=metric,
                value=getattr(bucket.measured, metric),
                verdict=bucket.verdict.verdict,
                detail=bucket.measured.name,
                **where,
            )
    report.verdict(result.compared, case=case, mode=mode, site="teacher_forced")


# ---------------------------------------------------------------------------------------------
# What the review page reads back (info rows beside the gate rows above)
# ---------------------------------------------------------------------------------------------


def token_text(tokens: torch.Tensor) -> str:
    """The `detail` of a `tokens` info row: each batch row's token ids, `row R: t0 t1 ...`, rows
    joined by `; ` (the review page shows the target's and the reference's side by side)."""
    return "; ".join(f"row {r}: " + " ".join(str(t) for t in row) for r, row in enumerate(tokens.tolist()))


def step_errors(want: torch.Tensor, have: torch.Tensor) -> list[float]:
    """Per step, the largest |have - want| of the step logits ([B, N, V]) over batch rows and
    vocabulary (NaN counted as inf), over the steps both sides have."""
    steps = min(int(want.shape[1]), int(have.shape[1]))
    per_step = (have[:, :steps].double() - want[:, :steps].double()).abs().nan_to_num(nan=float("inf")).amax(dim=(0, 2))
    return [float(v) for v in per_step]


def step_errors_text(errors: Sequence[float]) -> str:
    """The `detail` of a `step_max_abs` info row: the per-step values after the last `: `, in step
    order (the review page plots them)."""
    last = len(errors) - 1
    return f"largest |target - reference| of the step logits per step, steps 0-{last}: " + " ".join(f"{e:.3g}" for e in errors)

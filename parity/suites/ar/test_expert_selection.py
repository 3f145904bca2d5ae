"""expert_selection: which expert each token's MoE output came from, eager and under graphs.

vllm-project/vllm-omni#7318: a graph captured on all-zero dummy ids baked the understanding expert and
replayed it for every real token. Here each execution mode prepares the target's forward the
way a serving engine would (graph modes capture on all-zero ids), runs every case, and observes
per MoE layer and token which expert's output the layer used (taps on the post-attention norm and
the layer; both experts recomputed by the harness), against the reference routing `id >= start`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parity.compare import AT_MOST, EXACTLY, HIGHER, count_rule, diff, equality_rule, flag_rule
from parity.contract import requirement
from parity.runners import make_runner
from parity.suites.ar.decode import DecodeGraphs
from parity.suites.ar.support import (
    CASES,
    PROMPTS,
    TOL,
    ExpertUse,
    Prompt,
    ids_of,
    judge,
    moe_taps,
    observe_expert_use,
    record_policy_not_applicable,
    routing_mismatches,
    skip_full_size_compile,
    token_tensor,
)
from parity.suites.conftest import require_graph_support
from reference_models.ar.adapter import ReferenceARAdapter
from reference_models.checkpoints import random_state_dict

pytestmark = [pytest.mark.parity_suite("expert_selection"), pytest.mark.parity_keep_compile_cache]

GRAPH_TOL = {"compiled": "compiled_vs_eager_fp32", "compiled_cuda_graph": "compiled_vs_eager_fp32"}


ROUTING_COMPILE = CASES["routing_compile"]


def _prepare(models, mode: str, fn, example: tuple[torch.Tensor, ...], taps: dict, name: str, *, backend: str = "inductor"):
    runner = make_runner(mode, device=models.device, capture_registry=models.target.capture, backend=backend)
    return runner.prepare(fn, example, dummy="zeros", taps=taps, name=name)


def _record_routing(report, models, mode: str, case: str, ids: torch.Tensor, taps) -> None:
    """One gate row per MoE layer: tokens whose observed expert differs from `id >= start`, by the
    target's own experts and by the reference's weights (a loader that swapped the experts'
    tensors routes every token "right" by its own modules)."""
    for use in observe_expert_use(models.target, taps, TOL["expert_observation"], reference=models.reference):
        bad = routing_mismatches(use, ids, models.start)
        margin = float((use.distance_und - use.distance_gen).abs().min())
        detail = "; ".join(bad[:12]) + (f"; ... {len(bad) - 12} more" if len(bad) > 12 else "")
        verdict = count_rule(
            len(bad),
            0,
            metric="mismatched_tokens",
            at=AT_MOST,
            detail=detail or f"{ids.numel()} tokens routed as the reference routes them",
        )
        report.verdict(verdict, case=case, mode=mode, site=f"layer.{use.layer}")
        report.info(
            case=case,
            mode=mode,
            site=f"layer.{use.layer}",
            metric="observation_margin",
            value=margin,
            detail="min over tokens of |d(und) - d(gen)|: how clearly the output names its expert",
        )


@pytest.mark.parametrize("prompt", PROMPTS, ids=ids_of(PROMPTS))
def test_expert_selection(prompt: Prompt, mode: str, ar_models, report) -> None:
    """The case, prepared in `mode` (graph modes captured on all-zero ids), routed as the reference;
    in graph modes the logits also equal eager dispatch (the capture-time blend is numerically the
    eager split, up to GEMM-shape rounding or Inductor's fusion)."""
    models = ar_models
    require_graph_support(models.target, mode)
    skip_full_size_compile(models, mode)
    report.case, report.mode = prompt.name, mode  # an exception's error row names this case
    eager = make_runner("eager", device=models.device)
    tol = TOL[GRAPH_TOL.get(mode, "graph_vs_eager_fp32")]
    ids = models.ids(prompt.rows)
    with _prepare(models, mode, models.target.forward, (ids,), moe_taps(models.target), "forward") as prepared:
        result = prepared(ids)
    _record_routing(report, models, mode, prompt.name, ids, result.taps)
    if mode != "eager":
        with eager.prepare(models.target.forward, (ids,)) as reference_run:
            want = reference_run(ids).output.logits
        if models.dtype == torch.float32:
            measured = diff(want, result.output.logits, tol, name="logits vs eager dispatch")
            report.diff(measured, case=prompt.name, mode=mode, site="logits")
        else:
            _judge_against_golden(report, models, mode, prompt.name, ids, want, result.output.logits)


def _judge_against_golden(report, models, mode: str, case: str, ids, eager_logits, graph_logits) -> None:
    """Half precision: the graph's logits may be at most the noise-floor multiplier times as far
    from the fp64 golden as eager dispatch's are (`judge`). A fixed bound does not hold here:
    rounding of bf16 GEMMs of other shapes (the blend runs each expert on every row, eager dispatch
    on the gathered rows) compounds over the layers (0.07 max abs on the 28-layer model's logits on
    the H200), while the other expert moves a row by far more than eager dispatch's own distance."""
    golden = models.golden_forward(ids).logits
    verdict = judge(graph_logits, eager_logits, golden, name="logits vs eager dispatch, judged against the fp64 golden")
    report.verdict(verdict, case=case, mode=mode, site="logits")
    measured = diff(eager_logits, graph_logits, name="logits vs eager dispatch")
    for metric in ("max_abs", "mean_abs", "rel_l2", "cosine", "max_ulp"):
        report.info(
            case=case,
            mode=mode,
            site="logits",
            metric=metric,
            value=getattr(measured, metric),
            verdict=verdict.verdict,
        )


@pytest.mark.parametrize("mode", ["cpu_graph", "cuda_graph"])
def test_dummy_capture_runs_both_experts(mode: str, ar_models, report, device, target) -> None:
    """A graph captured on an all-false mask (all-zero ids) still contains the gen expert, so it
    can serve gen tokens; eager on the same ids keeps its und-only fast path."""
    models = ar_models
    if mode == "cuda_graph" and device.type != "cuda":
        pytest.skip("cuda_graph needs --device cuda")
    if mode == "cpu_graph" and device.type != "cpu":
        pytest.skip("cpu_graph is the CPU lane's stand-in")
    require_graph_support(models.target, mode)
    skip_full_size_compile(models, mode)
    ids = models.ids(PROMPTS[0].rows).zero_()
    taps = {}
    for site in models.target.moe_sites():
        taps[f"und.{site.layer}"] = site.und
        taps[f"gen.{site.layer}"] = site.gen
    run_modes = ["eager", mode]
    for site in models.target.moe_sites():  # eager's und-only fast path is a policy (docs/targets.md §5)
        where = dict(case="dummy-capture-all-und-ids", mode="eager", site=f"layer.{site.layer}")
        if record_policy_not_applicable(report, target, "eager_fast_path", metrics=["gen_expert_calls"], **where):
            run_modes = [mode]
    for run_mode in run_modes:
        with _prepare(models, run_mode, models.target.forward, (ids,), taps, "forward") as prepared:
            result = prepared(ids)
        for site in models.target.moe_sites():
            gen_calls = len(result.taps[f"gen.{site.layer}"])
            und_calls = len(result.taps[f"und.{site.layer}"])
            if run_mode == "eager":
                verdict = count_rule(
                    gen_calls,
                    0,
                    metric="gen_expert_calls",
                    at=EXACTLY,  # no call at all (a count: the same verdict as at most 0)
                    detail=f"eager, all-und ids: fast path runs und only (und calls {und_calls})",
                )
            else:  # both experts in the graph: the row shows the gen expert's calls
                verdict = flag_rule(
                    gen_calls >= 1 and und_calls >= 1,
                    metric="gen_expert_calls",
                    value=gen_calls,
                    better=HIGHER,
                    detail=f"captured on all-zero ids: the graph holds both experts (und calls {und_calls})",
                )
            report.verdict(
                verdict,
                case="dummy-capture-all-und-ids",
                mode=run_mode,
                site=f"layer.{site.layer}",
            )


KEYED_MODES = ("eager", "cpu_graph", "cuda_graph", "compiled_cuda_graph")


def test_keyed_decode_graphs_route_as_reference(mode: str, ar_models, report) -> None:
    """Mask-keyed decode graphs (vllm-project/vllm-omni#9865; docs/model.md §4): the target's decode
    step prepared once per key it declares and batch size (graph modes capture each on all-zero
    ids, as an engine does), every prompt fed one token per step, each step on the graph the target
    picks from the host's per-row state (here the case's tokens, host data). Every token must be
    routed as the reference routes it (a mixed batch replayed on a single-expert graph sends some
    tokens to the wrong expert), a step without gen tokens must not run the gen expert (text-only
    decode pays no blend) and a step of gen tokens only must not run the und expert of the MoE
    layers (image decode pays no blend either). Rows per prompt (`keyed-decode-<prompt>`)."""
    models = ar_models
    if mode not in KEYED_MODES:
        pytest.skip(f"{mode}: keyed decode graphs are checked eager and in the modes that capture a graph")
    require_graph_support(models.target, mode)
    skip_full_size_compile(models, mode)
    if not getattr(models.target, "decode_graph_keys", None):
        keys = requirement("decode_graph_keys")
        pytest.skip(f"the {models.target.name} target declares no {keys.rule} ({keys.words}, {keys.cite})")
    target = models.target
    taps = moe_taps(target)
    for site in target.moe_sites():
        taps[f"gen.{site.layer}"] = site.gen
        taps[f"und.{site.layer}"] = site.und
    by_batch: dict[int, list[Prompt]] = {}
    for prompt in PROMPTS:
        by_batch.setdefault(len(prompt.rows), []).append(prompt)
    for batch, prompts in by_batch.items():
        target.allocate_decode_state(batch, max(len(prompt.rows[0]) for prompt in prompts))
        with DecodeGraphs(models, mode, batch, taps=taps) as graphs:
            for prompt in prompts:
                _keyed_decode_prompt(report, models, mode, graphs, prompt)
                _keyed_decode_prompt(report, models, mode, graphs, prompt, unknown_row=True)


def _keyed_decode_prompt(report, models, mode: str, graphs: DecodeGraphs, prompt: Prompt, *, unknown_row: bool = False) -> None:
    """One prompt through the keyed graphs: gate rows per MoE layer and for the gen-expert calls.

    `unknown_row`: the host does not know the kind of row 0's token at any step (`None`: a request
    that may have sampled `image_start`, docs/targets.md §3.2), the other rows' kinds it knows.
    Such a batch must replay a graph that routes both kinds (the blend): every token routed as the
    reference routes it is the whole check (case `keyed-decode-unknown-<prompt>`). A key that reads
    None as text keys und-only and sends row 0's gen tokens to the und expert; one that reads it as
    gen, or leaves the row out, does the same to its text tokens."""
    target = models.target
    case = f"keyed-decode-{'unknown-' if unknown_row else ''}{prompt.name}"
    report.case, report.mode = case, mode  # an exception's error row names this case
    host_ids = token_tensor(prompt.rows, models.config, models.size, torch.device("cpu"))
    ids = host_ids.to(models.device)
    batch, length = ids.shape
    before = dict(graphs.replays)
    per_step: list[list[ExpertUse]] = []
    single_kind_steps = {"und": 0, "gen": 0}  # steps whose batch holds text tokens only / gen tokens only
    other_expert_calls = {"und": 0, "gen": 0}  # calls of the expert such a step must not run
    for pos in range(length):
        generating: list[bool | None] = (host_ids[:, pos] >= models.start).tolist()
        if unknown_row:
            generating[0] = None
        result = graphs.run(ids[:, pos : pos + 1], torch.full((batch,), pos, device=models.device), generating)
        per_step.append(observe_expert_use(target, result.taps, TOL["expert_observation"], reference=models.reference))
        kind = None if None in generating else "gen" if all(generating) else "und" if not any(generating) else None
        if kind is not None:
            other = "und" if kind == "gen" else "gen"
            single_kind_steps[kind] += 1
            other_expert_calls[kind] += sum(len(result.taps[f"{other}.{site.layer}"]) for site in target.moe_sites())
    replays = {str(key): count - before[key] for key, count in graphs.replays.items()}
    for uses in zip(*per_step, strict=True):  # one MoE layer, every step: [B, 1] per step -> [B, L]
        fields = ("used_gen", "matched", "distance_und", "distance_gen", "used_gen_by_reference")
        use = ExpertUse(uses[0].layer, *(_joined([getattr(u, field) for u in uses]) for field in fields))
        bad = routing_mismatches(use, ids, models.start)
        detail = "; ".join(bad[:12]) + (f"; ... {len(bad) - 12} more" if len(bad) > 12 else "")
        detail = detail or f"{ids.numel()} tokens routed as the reference routes them"
        verdict = count_rule(len(bad), 0, metric="mismatched_tokens", at=AT_MOST, detail=f"{detail}; replays per key {replays}")
        report.verdict(verdict, case=case, mode=mode, site=f"layer.{use.layer}")
    if unknown_row:  # no step of this pass holds one known kind only
        return
    for kind, metric, held in (
        ("und", "gen_expert_calls_without_gen_tokens", "no gen token"),
        ("gen", "und_expert_calls_without_text_tokens", "gen tokens only"),
    ):
        other = "und" if kind == "gen" else "gen"
        report.verdict(
            count_rule(
                other_expert_calls[kind],
                0,
                metric=metric,
                at=EXACTLY,  # none at all (a count: the same verdict as at most 0)
                detail=f"{other} expert calls in the MoE layers over the {single_kind_steps[kind]} step(s) whose batch "
                f"held {held} (they must replay a single-expert graph, not the blend); replays per key {replays}",
            ),
            case=case,
            mode=mode,
        )


def _joined(steps: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Per-step [B, 1] observations as [B, L] (None when a step was not judged)."""
    return None if any(step is None for step in steps) else torch.cat(steps, dim=1)


@pytest.mark.parametrize("prompt", PROMPTS, ids=ids_of(PROMPTS))
def test_multimodal_entry_routes_gen_tokens(prompt: Prompt, mode: str, ar_models, report) -> None:
    """The entry point a runner uses on the multimodal path (inputs_embeds and input_ids) routes gen
    tokens to the gen expert (vllm-project/vllm-omni#9851: input_ids dropped, the gen expert never ran)."""
    models = ar_models
    require_graph_support(models.target, mode)
    skip_full_size_compile(models, mode)
    case = f"multimodal-{prompt.name}"
    report.case, report.mode = case, mode  # an exception's error row names this case
    ids = models.ids(prompt.rows)
    embeds = models.target.embed(ids)
    taps = moe_taps(models.target)
    # routing only, no numeric gate: compiled modes trace with the routing backend (cases/ar.toml [routing_compile])
    backend = ROUTING_COMPILE.backend
    with _prepare(
        models, mode, models.target.forward_multimodal, (embeds, ids), taps, "forward_multimodal", backend=backend
    ) as run:
        result = run(embeds, ids)
    _record_routing(report, models, mode, case, ids, result.taps)


@pytest.mark.parametrize("case", CASES["moe_ranges"], ids=ids_of(CASES["moe_ranges"]))
def test_moe_type_layer_range(case, ar_models, report, target) -> None:
    """`moe_type` ranges are half-open and 0-based: on a tiny variant whose range ends before the
    last layer, gen tokens take the gen expert on exactly the listed layers (an inclusive or
    shifted reading adds or moves a layer). Weights from the reference's random init for that
    configuration; the target is built from them."""
    models = ar_models
    if models.size != "tiny":
        pytest.skip("moe_type range variants are built on the tiny configuration")
    config = dataclasses.replace(models.config, moe_type=case.moe_type)
    state = random_state_dict(config, models.seed, models.device, models.dtype)
    variant = target.build_ar(config, state, models.device, models.dtype)
    truth = ReferenceARAdapter.build(config, state, models.device, models.dtype)  # the variant's own reference
    layers = sorted(site.layer for site in variant.moe_sites())
    report.verdict(
        equality_rule(
            layers,
            case.expected_layers,
            metric="moe_layers_match",
            detail=f"moe_type {case.moe_type!r}: the layers the target built gen experts on",
        ),
        case=case.name,
    )
    ids = models.ids(PROMPTS[2].rows)  # mixed
    with make_runner("eager", device=models.device).prepare(variant.forward, (ids,), taps=moe_taps(variant)) as run:
        result = run(ids)
    _record_routing(report, dataclasses.replace(models, target=variant, reference=truth), "eager", case.name, ids, result.taps)

"""benchmark: what graph safety costs and what graphs and compile buy, as ratios measured in one run.

1. AR decode step, batch 1 and 8, context 1024 (64 on the CPU smoke lane), und-only traffic:
   eager single-expert dispatch, a graph of the same single-expert step, and the graph-captured
   blend that runs both experts on every token (the blend tax: vllm-project/vllm-omni#9764 measured +25% end to
   end on an H200). Ratios: blend / single-expert graph (the tax), blend / eager, eager / graph.
2. The decode step against the HBM floor: weight and KV-cache bytes read per step over the copy
   bandwidth measured in the same run.
3. DiT forward eager vs regional compile (the seed measured -14% on an H800, -30% on an A800).

Timing is never asserted: every number is a row (suite `benchmark`, raw milliseconds as info rows,
ratios as rows without a bound). pytest-benchmark records the primary measurement of each test.
On the CPU lane the same code runs on the tiny models with the CPU graph stand-in: a smoke run of
the benchmark code, not a measurement anyone should quote. Run without xdist: `-p no:xdist`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import pytest
import torch

from parity.observe.regional import compile_repeated_blocks
from parity.runners import make_runner
from reference_models.ar.config import ar_config
from reference_models.checkpoints import random_state_dict
from reference_models.dit.checkpoint import random_state_dict as dit_random_state_dict
from reference_models.dit.config import config_for_size

pytestmark = [pytest.mark.suite("benchmark"), pytest.mark.benchmark]


@dataclasses.dataclass(frozen=True)
class Plan:
    context: int
    batches: tuple[int, ...]
    iterations: int
    dit_latent: int
    dit_text: int


PLANS = {
    "cuda": Plan(context=1024, batches=(1, 8), iterations=50, dit_latent=128, dit_text=77),
    "cpu": Plan(context=64, batches=(1, 8), iterations=5, dit_latent=32, dit_text=16),
}


def _median_ms(fn: Callable[[], object], device: torch.device, iterations: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iterations):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    numel = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(numel, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, 10)
    return 2 * numel / (ms / 1e3)


@pytest.fixture(scope="module")
def ar_pair(settings, target):
    """The target at the run's size, with and without its gen experts (moe_type 'none', same weights)."""
    device, dtype = torch.device(settings.device), settings.torch_dtype
    config = ar_config(settings.size)
    state = random_state_dict(config, settings.seed, device, dtype)
    blended = target.build_ar(config, state, device, dtype)
    single_config = dataclasses.replace(config, moe_type="none")
    single_state = {k: v for k, v in state.items() if ".gen_mlp." not in k}
    single = target.build_ar(single_config, single_state, device, dtype)
    return config, blended, single


def _weight_bytes(adapter, batch: int, with_gen: bool) -> int:
    """Bytes of parameters one decode step reads: every weight once, embedding tables only per token."""
    embeddings = {id(m.weight) for m in adapter.embedding_modules() if m is not None}
    total = 0
    for name, param in adapter.module.named_parameters():
        if id(param) in embeddings:
            total += batch * param.shape[1] * param.element_size()
        elif with_gen or ".gen_mlp." not in name:
            total += param.numel() * param.element_size()
    return total


def _kv_bytes(config, batch: int, context: int, element_size: int) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * batch * context * config.num_key_value_heads * head_dim * element_size


def test_decode_step_blend_tax_and_graph_speedup(ar_pair, settings, report, benchmark) -> None:
    config, blended, single = ar_pair
    device = torch.device(settings.device)
    plan = PLANS[device.type]
    graph_mode = "cuda_graph" if device.type == "cuda" else "cpu_graph"
    bandwidth = _copy_bandwidth(device)
    report.info(
        case="copy-bandwidth",
        metric="copy_bandwidth_gb_s",
        value=bandwidth / 1e9,
        better="higher",
        detail="device-to-device copy, bytes read + written, median of 10",
    )
    generator = torch.Generator().manual_seed(settings.seed)
    for batch in plan.batches:
        case = f"decode-b{batch}-ctx{plan.context}"
        prompt = torch.randint(0, config.gen_vocab_start_index, (batch, plan.context), generator=generator).to(device)
        ids = torch.randint(0, config.gen_vocab_start_index, (batch, 1), generator=generator).to(device)  # und-only
        positions = torch.full((batch,), plan.context, dtype=torch.long, device=device)
        timings = {}
        for label, adapter in (("blend", blended), ("single", single)):
            adapter.allocate_decode_state(batch, plan.context + 1)
            adapter.prefill(prompt)
            if label == "single":
                timings["eager_single"] = _median_ms(
                    lambda a=adapter, i=ids, p=positions: a.decode_step(i, p), device, plan.iterations
                )
            runner = make_runner(graph_mode, device=device, capture_registry=adapter.capture)
            with runner.prepare(adapter.decode_step, (ids, positions), dummy="zeros", name=f"decode_step[{label}]") as run:
                adapter.prefill(prompt)  # the capture wrote dummy k/v at position 0
                timings[f"graph_{label}"] = _median_ms(lambda r=run, i=ids, p=positions: r(i, p), device, plan.iterations)
                if label == "blend" and batch == plan.batches[0]:
                    benchmark.pedantic(lambda r=run, i=ids, p=positions: r(i, p), rounds=plan.iterations, warmup_rounds=2)
        for label, ms in timings.items():
            report.info(case=case, metric=f"{label}_ms", value=ms, detail=f"median of {plan.iterations}, und-only batch")
        ratios = {
            "blend_tax": (
                timings["graph_blend"] / timings["graph_single"],
                "graph blend / graph single-expert: both experts on every token",
            ),
            "blend_vs_eager_single": (
                timings["graph_blend"] / timings["eager_single"],
                "graph blend / eager single-expert dispatch",
            ),
            "graph_speedup": (timings["eager_single"] / timings["graph_single"], "eager / graph replay, same single-expert step"),
        }
        element = next(blended.module.parameters()).element_size()
        for label, with_gen in (("blend", True), ("single", False)):
            step_bytes = _weight_bytes(blended, batch, with_gen) + _kv_bytes(config, batch, plan.context, element)
            floor_ms = step_bytes / bandwidth * 1e3
            ratios[f"hbm_floor_ratio_{label}"] = (
                timings[f"graph_{label}"] / floor_ms,
                f"graph {label} step / ({step_bytes / 1e9:.2f} GB read per step at {bandwidth / 1e9:.0f} GB/s = {floor_ms:.3f} ms)",
            )
        for metric, (value, detail) in ratios.items():
            report.record(
                case=case, metric=metric, value=value, detail=detail, better="lower" if "speedup" not in metric else "higher"
            )


@pytest.fixture(scope="module")
def dit_model(settings, target):
    device, dtype = torch.device(settings.device), settings.torch_dtype
    config = config_for_size(settings.size)
    return target.build_dit(config, dit_random_state_dict(config, settings.seed, device, dtype), device, dtype)


def test_dit_regional_compile_speedup(dit_model, settings, report, benchmark) -> None:
    device = torch.device(settings.device)
    plan = PLANS[device.type]
    adapter = dit_model
    config = adapter.config
    generator = torch.Generator().manual_seed(settings.seed)
    latents = torch.randn(1, config.in_channels, plan.dit_latent, plan.dit_latent, generator=generator).to(device, adapter.dtype)
    timestep = torch.full((1,), 0.5, device=device, dtype=adapter.dtype)
    text, mask = adapter.text_condition(plan.dit_text, settings.seed)
    step = lambda: adapter.forward(latents, timestep, text, mask)
    eager_ms = _median_ms(step, device, plan.iterations)
    compiled = compile_repeated_blocks(adapter.module, dynamic=True, fullgraph=True)
    try:
        t0 = time.perf_counter()
        step()
        compile_s = time.perf_counter() - t0
        compiled_ms = _median_ms(step, device, plan.iterations)
        benchmark.pedantic(step, rounds=plan.iterations, warmup_rounds=1)
    finally:
        compiled.restore()
    case = f"dit-{plan.dit_latent}x{plan.dit_latent}-text{plan.dit_text}"
    report.info(case=case, metric="eager_ms", value=eager_ms, detail=f"median of {plan.iterations}")
    report.info(case=case, metric="compiled_ms", value=compiled_ms, detail=f"{compiled.count} blocks regionally compiled")
    report.info(case=case, metric="first_compiled_call_s", value=compile_s, detail="includes Inductor compilation")
    report.record(
        case=case,
        metric="compile_speedup",
        value=eager_ms / compiled_ms,
        better="higher",
        detail=f"eager / regional compile; {compiled.count} TransformerBlock modules compiled",
    )

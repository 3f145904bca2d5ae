"""benchmark: what graph safety costs and what graphs and compile buy, as ratios measured in one run.

1. AR decode step, batch 1 and 8, context 1024 (64 on the CPU smoke lane): eager single-expert
   dispatch, a graph of the single-expert model (moe_type none, same weights), and the three
   mask-keyed graphs of the MoE model (docs/model.md §4): the und-only graph (what text-only
   batches replay), the gen-only graph (what a batch of image requests replays, fed gen tokens);
   each should cost what the single-expert graph costs; and the blended graph that runs both
   experts on every token (what a mixed batch needs; the blend tax: vllm-project/vllm-omni#9764
   measured +25% end to end on an H200), set against the ratio of the bytes it reads. On CUDA the
   keyed graphs are also measured compiled (Inductor, then captured) at batch 1.
2. The decode step against the HBM floor: weight and KV-cache bytes read per step over the copy
   bandwidth measured in the same run; and where the rest goes: a torch.profiler breakdown of each
   graph's step by kernel (launches, GEMM / attention / other time), written as tables into the
   run directory (`benchmark/decode-profile-*.txt` and `.csv`). On CUDA, a target that offers
   `unfused_kernels()` (the built-in one: its fused decode kernels) also has its und-only graph
   captured with the torch ops those kernels replace, for `fused_kernels_speedup`.
3. DiT forward eager vs regional compile (the seed measured -14% on an H800, -30% on an A800).
4. DiT attention with SDPA's native GQA vs K/V repeated per query head (the formulation the port
   replaced), time and peak memory of one block's attention and of the whole forward, at 1024 px.

The variants a ratio compares are timed round-robin, one call of each per round (CUDA events
around each call on the GPU), and each is the median over the rounds: timed one after the other,
two graphs with the same kernels measured 8% apart on the H200.

Timing is never asserted: every number is a row (suite `benchmark`, raw milliseconds as info rows,
ratios as rows without a bound). pytest-benchmark records the primary measurement of each test.
On the CPU lane the same code runs on the tiny models with the CPU graph stand-in: a smoke run of
the benchmark code, not a measurement anyone should quote. Run without xdist: `-p no:xdist`.
Each test names the card it ran on (an info row `device_name` and pytest-benchmark's `extra_info`):
an H100 and an H200 give other milliseconds for the same code (docs/gpu-results.md).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from parity.compare import better_of
from parity.env import device_name
from parity.observe.regional import compile_repeated_blocks
from parity.runners import make_runner
from parity.suites.benchmarks.profiling import profile_step
from reference_models.ar.config import ar_config
from reference_models.checkpoints import random_state_dict
from reference_models.dit.checkpoint import random_state_dict as dit_random_state_dict
from reference_models.dit.config import config_for_size

pytestmark = [pytest.mark.parity_suite("benchmark"), pytest.mark.benchmark]


@pytest.fixture(autouse=True)
def _card(benchmark, settings, report) -> None:
    """The card (or CPU) the timings come from, beside them in the rows and in pytest-benchmark's JSON."""
    name = device_name(settings.device)
    benchmark.extra_info["device_name"] = name
    report.info(case="card", metric="device_name", value=None, detail=f"timed on {settings.device}: {name}")


@dataclasses.dataclass(frozen=True)
class Plan:
    context: int
    batches: tuple[int, ...]
    iterations: int
    compiled_batches: tuple[int, ...]  # decode batches also measured compiled + captured
    profile_steps: int
    dit_latent: int
    dit_text: int


PLANS = {
    "cuda": Plan(
        context=1024, batches=(1, 8), iterations=50, compiled_batches=(1,), profile_steps=10, dit_latent=128, dit_text=77
    ),
    # the CPU smoke run compiles nothing here: Inductor on the CPU is what the suites measure
    "cpu": Plan(context=64, batches=(1, 8), iterations=5, compiled_batches=(), profile_steps=2, dit_latent=32, dit_text=16),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _peak_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Memory a call allocates beyond what was allocated before it, at its peak (CUDA only)."""
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


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


def _graph_steps(adapter, mode: str, device: torch.device, ids, positions, label: str, keyed: bool) -> dict[str, object]:
    """The adapter's decode step prepared in `mode` once per mask-keyed graph it declares (the key
    selected through `host_prepare`, so the capture bakes it); one graph, the adapter's default,
    for a target without keys or when `keyed` is False (the single-expert baseline)."""
    runner = make_runner(mode, device=device, capture_registry=adapter.capture, dynamic=False)
    keys = tuple(getattr(adapter, "decode_graph_keys", None) or (None,)) if keyed else (None,)
    runs = {}
    for key in keys:
        select = None if key is None else (lambda *_inputs, key=key: adapter.select_decode_graph(key))
        runs[key or "blend"] = runner.prepare(
            adapter.decode_step, (ids, positions), dummy="zeros", name=f"decode_step[{label}:{key}]", host_prepare=select
        )
    return runs


def _profile(report, run_dir: Path, case: str, label: str, step: Callable[[], object], device, steps: int) -> None:
    profiled = profile_step(step, device, steps)
    path = profiled.write(run_dir / "benchmark" / f"decode-profile-{case}-{label}", f"{case}: {label} decode step")
    unit = "kernels" if device.type == "cuda" else "ATen ops"
    where = {"case": case, "site": label}
    report.info(
        metric="launches_per_step", value=profiled.launches_per_step, detail=f"{unit} per step; table {path.name}", **where
    )
    for part in ("gemm", "attention", "other"):
        report.info(
            metric=f"{part}_ms",
            value=profiled.category_ms(part),
            detail=f"{unit} classified {part} by name, busy time per step ({profiled.steps} steps profiled)",
            **where,
        )


def _interleaved_ms(
    steps: dict[str, Callable[[], object]], device: torch.device, rounds: int, warmup: int = 3
) -> dict[str, float]:
    """Median milliseconds per call of each step, timed round-robin (one call of each per round), so
    a drift of clocks or host load over the measurement lands on every step alike rather than on
    whichever was timed last."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            samples[name].append(_median_ms(fn, device, 1, warmup=0))
    return {name: statistics.median(values) for name, values in samples.items()}


def test_decode_step_blend_tax_and_graph_speedup(ar_pair, settings, report, benchmark, run_dir) -> None:
    config, blended, single = ar_pair
    device = torch.device(settings.device)
    plan = PLANS[device.type]
    graph_mode = "cuda_graph" if device.type == "cuda" else "cpu_graph"
    bandwidth = _copy_bandwidth(device)
    report.info(
        case="copy-bandwidth",
        metric="copy_bandwidth_gb_s",
        value=bandwidth / 1e9,
        detail="device-to-device copy, bytes read + written, median of 10",
    )
    generator = torch.Generator().manual_seed(settings.seed)
    for batch in plan.batches:
        case = f"decode-b{batch}-ctx{plan.context}"
        prompt = torch.randint(0, config.gen_vocab_start_index, (batch, plan.context), generator=generator).to(device)
        ids = torch.randint(0, config.gen_vocab_start_index, (batch, 1), generator=generator).to(device)  # und-only
        # a batch of image requests: gen ids, fed to the gen-only graph (the others are fed text ids)
        gen_ids = torch.randint(
            config.gen_vocab_start_index, config.gen_vocab_start_index + config.gen_vocab_size, (batch, 1), generator=generator
        ).to(device)
        positions = torch.full((batch,), plan.context, dtype=torch.long, device=device)
        generating = [False] * batch  # the host's request state: text requests only
        steps: dict[str, Callable[[], object]] = {"eager_single": lambda i=ids, p=positions: single.decode_step(i, p)}
        runs = []
        modes = [(graph_mode, "graph")] + ([("compiled_cuda_graph", "compiled_graph")] if batch in plan.compiled_batches else [])
        try:
            for adapter in (single, blended):  # each graph captures its adapter's KV cache: allocate once
                adapter.allocate_decode_state(batch, plan.context + 1)
            for mode, prefix in modes:
                for label, adapter in (("single", single), ("moe", blended)):
                    if label == "single" and prefix != "graph":
                        continue  # the single-expert baseline is the plain graph
                    for key, run in _graph_steps(adapter, mode, device, ids, positions, label, keyed=label == "moe").items():
                        runs.append(run)
                        fed = gen_ids if key == "gen_only" else ids
                        steps[f"{prefix}_{'single' if label == 'single' else key}"] = lambda r=run, i=fed, p=positions: r(i, p)
            if (
                device.type == "cuda"
                and hasattr(blended, "unfused_kernels")
                and "und_only" in getattr(blended, "decode_graph_keys", ())
            ):
                # a target's fused decode kernels (CUDA only) against the torch ops they replace
                with blended.unfused_kernels():
                    run = _graph_steps(blended, graph_mode, device, ids, positions, "moe-unfused", keyed=True)["und_only"]
                runs.append(run)
                steps["graph_und_only_unfused"] = lambda r=run, i=ids, p=positions: r(i, p)
            for adapter in (single, blended):
                adapter.prefill(prompt)  # the captures wrote dummy k/v at position 0
            for name, step in steps.items():
                if name != "eager_single":
                    _profile(report, run_dir, case, name, step, device, plan.profile_steps)
            timings = _interleaved_ms(steps, device, plan.iterations)
            picked = blended.decode_graph_key(generating) if hasattr(blended, "decode_graph_key") else "blend"
            report.info(case=case, metric="graph_picked_for_text_batch", value=None, detail=f"the target picks {picked!r}")
            if batch == plan.batches[0]:
                benchmark.pedantic(steps[f"graph_{picked}"], rounds=plan.iterations, warmup_rounds=2)
        finally:
            for run in runs:
                run.close()
            if hasattr(blended, "select_decode_graph"):
                blended.select_decode_graph(None)
        for label, ms in timings.items():
            report.info(
                case=case,
                metric=f"{label}_ms",
                value=ms,
                detail=f"median of {plan.iterations} rounds timing every variant once each, "
                + ("a batch of gen tokens" if "gen_only" in label else "und-only batch"),
            )
        _decode_ratios(report, case, config, blended, batch, plan, bandwidth, timings)


def _decode_ratios(report, case: str, config, blended, batch: int, plan: Plan, bandwidth: float, timings: dict) -> None:
    ratios = {
        "blend_tax": ("graph_blend", "graph_single", "graph blend / graph single-expert: both experts on every token"),
        "und_only_vs_single": (
            "graph_und_only",
            "graph_single",
            "graph und-only (the keyed graph a text batch replays) / graph of the single-expert model",
        ),
        "gen_only_vs_single": (
            "graph_gen_only",
            "graph_single",
            "graph gen-only (the keyed graph a batch of image requests replays) / graph of the single-expert model",
        ),
        "blend_vs_eager_single": ("graph_blend", "eager_single", "graph blend / eager single-expert dispatch"),
        "graph_speedup": ("eager_single", "graph_single", "eager / graph replay, same single-expert step"),
        "fused_kernels_speedup": (
            "graph_und_only_unfused",
            "graph_und_only",
            "und-only graph with the torch ops / with the fused decode kernels (serving_models/ar/kernels.py)",
        ),
        "compile_speedup_und_only": ("graph_und_only", "compiled_graph_und_only", "graph / compiled graph, und-only key"),
        "compile_speedup_gen_only": ("graph_gen_only", "compiled_graph_gen_only", "graph / compiled graph, gen-only key"),
        "compile_speedup_blend": ("graph_blend", "compiled_graph_blend", "graph / compiled graph, blend key"),
    }
    for metric, (num, den, detail) in ratios.items():
        if num in timings and den in timings:
            value = timings[num] / timings[den]
            report.record(case=case, metric=metric, value=value, detail=detail, better=better_of(metric))
    element = next(blended.module.parameters()).element_size()
    kv = _kv_bytes(config, batch, plan.context, element)
    if "graph_blend" in timings and "graph_single" in timings:
        # a mixed batch must read both experts: its fair cost is the blend's bytes over the single step's
        bytes_ratio = (_weight_bytes(blended, batch, True) + kv) / (_weight_bytes(blended, batch, False) + kv)
        report.record(
            case=case,
            metric="blend_tax_vs_bytes",
            value=timings["graph_blend"] / timings["graph_single"] / bytes_ratio,
            better=better_of("blend_tax_vs_bytes"),
            detail=f"blend_tax / the ratio of bytes the blend and the single-expert step read ({bytes_ratio:.3f}); "
            "at most 1: the blend costs no more than the weights it must read",
        )
    for name, ms in timings.items():
        if name == "eager_single":
            continue
        with_gen = "blend" in name
        step_bytes = _weight_bytes(blended, batch, with_gen) + kv
        floor_ms = step_bytes / bandwidth * 1e3
        report.record(
            case=case,
            metric=f"hbm_floor_ratio_{name.removeprefix('graph_')}",
            value=ms / floor_ms,
            better=better_of("hbm_floor_ratio_*"),
            detail=(
                f"{name} step / ({step_bytes / 1e9:.2f} GB read per step at {bandwidth / 1e9:.0f} GB/s = {floor_ms:.3f} ms); "
                f"{floor_ms / ms:.2f} of the floor"
            ),
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
        better=better_of("compile_speedup"),
        detail=f"eager / regional compile; {compiled.count} TransformerBlock modules compiled",
    )


def test_dit_attention_without_kv_copies(dit_model, settings, report, benchmark) -> None:
    """SDPA's native GQA against K/V repeated per query head, side by side in one run: one main-stack
    block's attention on the inputs it gets in a real forward, and the whole forward."""
    device = torch.device(settings.device)
    plan = PLANS[device.type]
    adapter = dit_model
    switches = [m for m in adapter.module.modules() if hasattr(m, "materialise_kv_heads")]
    if not switches:
        pytest.skip(f"the {adapter.name} DiT has no materialise_kv_heads switch to compare against")
    config = adapter.config
    generator = torch.Generator().manual_seed(settings.seed)
    latents = torch.randn(1, config.in_channels, plan.dit_latent, plan.dit_latent, generator=generator).to(device, adapter.dtype)
    timestep = torch.full((1,), 0.5, device=device, dtype=adapter.dtype)
    text, mask = adapter.text_condition(plan.dit_text, settings.seed)
    forward = lambda: adapter.forward(latents, timestep, text, mask)
    attention = switches[-1]  # the last attention of the main stack: image and text tokens
    captured: dict[str, tuple] = {}
    hook = attention.register_forward_pre_hook(lambda _m, args: captured.setdefault("args", args))
    try:
        forward()
    finally:
        hook.remove()
    attend = lambda: attention(*captured["args"])

    def variant(materialise: bool, fn: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:
            for module in switches:
                module.materialise_kv_heads = materialise
            return fn()

        return call

    labels = {"gqa": False, "repeat_kv": True}
    try:
        # timed round-robin (one call of each variant per round), as the decode variants are
        timings = _interleaved_ms(
            {
                f"{label}/{part}": variant(materialise, fn)
                for label, materialise in labels.items()
                for part, fn in (("attention_ms", attend), ("forward_ms", forward))
            },
            device,
            plan.iterations,
        )
        results: dict[str, dict[str, float | None]] = {
            label: {
                "attention_ms": timings[f"{label}/attention_ms"],
                "forward_ms": timings[f"{label}/forward_ms"],
                "attention_peak_mib": _peak_mib(variant(materialise, attend), device),
                "forward_peak_mib": _peak_mib(variant(materialise, forward), device),
            }
            for label, materialise in labels.items()
        }
        benchmark.pedantic(variant(False, attend), rounds=plan.iterations, warmup_rounds=1)
    finally:
        for module in switches:
            module.materialise_kv_heads = False
    tokens = captured["args"][0].shape[1]
    case = f"dit-gqa-{plan.dit_latent}x{plan.dit_latent}-text{plan.dit_text}"
    heads = f"{attention.heads} query / {attention.kv_heads} K/V heads, {tokens} tokens"
    for label, numbers in results.items():
        for metric, value in numbers.items():
            if value is not None:
                report.info(
                    case=case,
                    site=label,
                    metric=metric,
                    value=value,
                    detail=f"{label}; {heads}; {'peak over one call' if metric.endswith('mib') else f'median of {plan.iterations} round-robin rounds'}",
                )
    for metric in results["gqa"]:
        native, repeated = results["gqa"][metric], results["repeat_kv"][metric]
        if native is not None and repeated:
            report.record(
                case=case,
                metric=f"gqa_vs_repeat_kv_{metric.removesuffix('_ms').removesuffix('_mib')}_{'time' if metric.endswith('ms') else 'memory'}",
                value=native / repeated,
                better=better_of("gqa_vs_repeat_kv_*"),
                detail=f"native GQA / K and V repeated per query head: {native:.3f} vs {repeated:.3f} {metric.rsplit('_', 1)[1]}; {heads}",
            )

"""What the DiT suites share: the case file, the models under test and the truth, and inputs.

`cases/dit.toml` is loaded here at import time (a malformed file is one collection error naming
file, table, key). The session fixture `dit_models` builds, for `--size`:

* tiny (CPU lane): a random checkpoint directory written by
  `reference_models.checkpoints.make_checkpoint("dit", "tiny", seed, dir)`, loaded by the target
  (`target.load_dit`) and by the reference (`ReferenceDiT.load`), both in the run's dtype;
* full (GPU lane): `random_state_dict(full_config(), seed, device, dtype)` in memory, handed to
  `target.build_dit` and `ReferenceDiT.build` (the same tensors, no copy).

An fp64 golden (the reference in fp64, same weights: they are bf16-exact) is built in every dtype;
the reference in the target's dtype is the eager noise the noise-floor rule measures against. Suites never import `serving_models`: the target comes from `--target`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import pytest
import torch
from torch import nn

from parity.cases import Count, NonNegative, Range, Seed, Steps, Table, check_safe_name, load_case_file
from parity.compare import better_of
from parity.compare.images import psnr
from parity.contract import requirement
from parity.observe.compile_ledger import CompileLedger, short_reason  # noqa: F401 - re-exported for the DiT suites
from parity.observe.regional import compile_repeated_blocks
from parity.plugin.session import RunSession
from parity.suites.device_memory import require_device_memory
from parity.target import DiTAdapter, Target
from reference_models.checkpoints import make_checkpoint
from reference_models.dit.adapter import ReferenceDiT
from reference_models.dit.checkpoint import expected_shapes, random_state_dict
from reference_models.dit.config import DiTConfig, config_for_size
from reference_models.dit.sampler import text_condition

Size = Literal["tiny", "full"]


# ---------------------------------------------------------------------------------------------
# The case file
# ---------------------------------------------------------------------------------------------

# Range checks of the case file (parity.cases.Range): latent sizes up to 1024 (the full model's
# cases use 128; one 1024x1024 latent is 262144 image tokens), text lengths up to 4096 tokens,
# timesteps and CFG ranges on the sampler's [0, 1] time axis, at least one sample per case.
Latent = Annotated[int, Range(1, 1024)]
TextLen = Annotated[int, Range(0, 4096)]
Time = Annotated[float, Range(0.0, 1.0)]


@dataclasses.dataclass(frozen=True)
class ModelsCase:
    checkpoint_seed: Seed
    block_class: str  # the repeated block's class name: compiled regionally, its `forward` counted


@dataclasses.dataclass(frozen=True)
class WarmupPoint:
    """A shape that is allowed to compile, with the count it must add and why."""

    height: Latent
    width: Latent
    text_len: TextLen
    cfg: bool
    expected_compiles: Count
    reason: str


@dataclasses.dataclass(frozen=True)
class RecompileLattice:
    backend: str
    backend_reason: str
    steps: Steps
    guidance_scale: NonNegative
    noise_seed: Seed
    text_seed: Seed
    sizes: Annotated[list[tuple[Latent, Latent]], Range(1, None)]
    text_lengths: Annotated[list[TextLen], Range(1, None)]
    cfg: list[bool]
    warmup: list[WarmupPoint]

    def __post_init__(self) -> None:
        if not self.warmup:
            raise ValueError("a recompile lattice needs at least one warm-up point")
        if self.guidance_scale <= 1.0:
            raise ValueError(f"guidance_scale must be > 1 so that cfg = on runs CFG, got {self.guidance_scale}")


@dataclasses.dataclass(frozen=True)
class VelocityCase:
    name: str
    size: Size
    height: Latent
    width: Latent
    text_lens: Annotated[list[TextLen], Range(1, 64)]  # one per sample; shorter ones are padded (mask false)
    timestep: Time
    seed: Seed


@dataclasses.dataclass(frozen=True)
class BlockCase:
    name: str
    size: Size
    height: Latent
    width: Latent
    text_len: TextLen
    timestep: Time
    seed: Seed


@dataclasses.dataclass(frozen=True)
class ImageCase:
    name: str
    size: Size
    height: Latent
    width: Latent
    text_len: TextLen
    steps: Steps
    guidance_scale: NonNegative
    cfg_range: tuple[Time, Time]
    seed: Seed
    text_seed: Seed
    negative_len: TextLen = 0  # > 0: a negative prompt of this many tokens for the unconditional branch
    negative_seed: Seed = 0


@dataclasses.dataclass(frozen=True)
class ScheduleLattice:
    """The sampler's schedule compared bit for bit at every (steps, latent size) point."""

    steps: list[int]
    sizes: list[tuple[int, int]]
    reason: str


@dataclasses.dataclass(frozen=True)
class SamplerCase:
    """The sampling loop of target and reference around one stand-in velocity (model-free)."""

    name: str
    size: Size
    dtype: Literal["fp32", "bf16", "fp16"]  # the loop's model dtype, whatever the run's dtype
    height: Latent
    width: Latent
    steps: Steps
    guidance_scale: NonNegative
    cfg_range: tuple[Time, Time]
    text_len: TextLen
    seed: Seed
    text_seed: Seed
    negative_len: TextLen = 0
    negative_seed: Seed = 0


@dataclasses.dataclass(frozen=True)
class NoiseFloorRule:
    """Why the golden noise floor (`parity.compare.golden_noise_rule`) judges one comparison."""

    reason: str


@dataclasses.dataclass(frozen=True)
class ImageThreshold:
    """The golden-relative image rule: PSNR(golden, candidate) >= PSNR(golden, comparison) -
    `golden_max_drop_db`, the comparison's distance from the golden counted as at least
    `min_noise_values` one-level differences when that is set (fp32: see `image_bound`)."""

    reason: str
    golden_max_drop_db: float
    min_noise_values: int | None = None

    def __post_init__(self) -> None:
        if self.golden_max_drop_db < 0:
            raise ValueError(f"golden_max_drop_db must be >= 0, got {self.golden_max_drop_db}")
        if self.min_noise_values is not None and self.min_noise_values < 1:
            raise ValueError(f"min_noise_values must be >= 1, got {self.min_noise_values}")


IMAGE_DATA_RANGE = 255.0  # delivered uint8 images (docs/images.md §3: declare it, record it)


def image_bound(golden: np.ndarray, comparison: np.ndarray, threshold: ImageThreshold) -> tuple[float, str]:
    """The least PSNR(golden, candidate) the rule accepts, and how it was computed.

    PSNR(golden, comparison) - `golden_max_drop_db`: the candidate may be `10**(drop/20)` times
    as far (RMSE) from the golden as the comparison is. With `min_noise_values`, the comparison's
    squared error is taken as at least that many one-level differences: in fp32 the two images
    differ from the golden only where a value sits within the float noise of a rounding boundary,
    a count of a few values that is itself noisy, and a comparison that happens to equal the
    golden (PSNR inf) would leave no room for one flipped value."""
    measured = psnr(golden, comparison, data_range=IMAGE_DATA_RANGE).value
    how = f"PSNR(golden, comparison) = {measured:.2f} dB"
    if threshold.min_noise_values is not None:
        floor_mse = threshold.min_noise_values / golden.size  # one level squared per value
        floor_db = 10.0 * math.log10(IMAGE_DATA_RANGE**2 / floor_mse)
        if measured > floor_db:
            how += f", taken as {floor_db:.2f} dB ({threshold.min_noise_values} one-level differences in {golden.size} values)"
            measured = floor_db
    return measured - threshold.golden_max_drop_db, f"{how} minus {threshold.golden_max_drop_db:g} dB"


CASE_FILE = "dit.toml"
CASES = load_case_file(
    CASE_FILE,
    {
        "models": Table(ModelsCase, many=False),
        "recompiles": Table(RecompileLattice, keyed=True),
        "noise_floor": Table(NoiseFloorRule, keyed=True),
        "velocity": Table(VelocityCase),
        "blocks": Table(BlockCase),
        "compiled": Table(BlockCase),
        "image_thresholds": Table(ImageThreshold, keyed=True),
        "image": Table(ImageCase),
        "schedule": Table(ScheduleLattice, many=False),
        "sampler": Table(SamplerCase),
    },
)


def cases_for(table: str, size: str) -> list[Any]:
    """The rows of `table` that run on configuration `size`."""
    return [case for case in CASES[table] if case.size == size]


def require_size(table: str, case: Any, size: str) -> None:
    """A test parametrized over every row of `table` runs the rows of this run's `size`: a row of
    the other configuration is skipped, and a table without a row for `size` is an error."""
    if not cases_for(table, size):
        raise LookupError(f"cases/{CASE_FILE}: no [[{table}]] cases for size {size}")
    if case.size != size:
        pytest.skip(f"{case.name} is a {case.size} case; this run builds the {size} models")


def lattice_for(size: str) -> RecompileLattice:
    try:
        return CASES["recompiles"][size]
    except KeyError:
        raise LookupError(f"cases/{CASE_FILE}: no [recompiles.{size}] table") from None


def noise_floor_reason(mode: str) -> str:
    """The reason of the golden noise floor for a row of `mode` (`[noise_floor.<comparison>]`):
    compiled rows compare compiled with eager, the others serving with reference."""
    key = "compiled_vs_eager" if mode == "compiled" else "serving_vs_reference"
    try:
        return CASES["noise_floor"][key].reason
    except KeyError:
        raise LookupError(f"cases/{CASE_FILE}: no [noise_floor.{key}]") from None


def image_threshold(dtype: str) -> ImageThreshold:
    try:
        return CASES["image_thresholds"][dtype]
    except KeyError:
        raise LookupError(f"cases/{CASE_FILE}: no [image_thresholds.{dtype}] for this run's dtype") from None


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class DiTModels:
    """The DiT under test and the truth, on the run's device."""

    target: DiTAdapter  # the target's DiT adapter, in the run's dtype
    reference: ReferenceDiT  # the truth in the run's dtype: the noise the golden rule measures
    golden: ReferenceDiT  # the truth in fp64
    config: DiTConfig
    size: str
    dtype: str
    device: torch.device
    source: str  # where the weights came from, for report details


def build_dit_models(settings: RunSession, target: Target, tmp_path_factory: pytest.TempPathFactory) -> DiTModels:
    """The target's DiT, the reference in the same dtype and the fp64 golden."""
    device = torch.device(settings.device)
    dtype = TORCH_DTYPES[settings.dtype]
    seed = CASES["models"].checkpoint_seed + settings.seed
    if settings.size == "tiny":
        directory = make_checkpoint("dit", "tiny", seed, tmp_path_factory.mktemp("dit-tiny"))
        adapter = target.load_dit(directory, device, dtype)
        reference = ReferenceDiT.load(directory, device, dtype)
        golden = ReferenceDiT.load(directory, device, torch.float64)
        config, source = reference.config, f"make_checkpoint('dit', 'tiny', {seed}) at {directory}"
    else:
        config = config_for_size(settings.size)
        parameters = sum(shape.numel() for shape in expected_shapes(config).values())
        require_device_memory("full-size DiT target, reference and golden", parameters, (dtype, dtype, torch.float64), device)
        state = random_state_dict(config, seed, device, dtype)
        adapter = target.build_dit(config, state, device, dtype)
        reference = ReferenceDiT.build(config, state, device, dtype)
        golden = ReferenceDiT.build(config, {k: v.double() for k, v in state.items()}, device, torch.float64)
        source = f"random_state_dict({settings.size}, seed {seed}) on {device}"
    return DiTModels(adapter, reference, golden, config, settings.size, settings.dtype, device, source)


# ---------------------------------------------------------------------------------------------
# Inputs (fp32 on the CPU: every adapter casts them to its own device and dtype)
# ---------------------------------------------------------------------------------------------


def seeded_latents(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def text_inputs(config: DiTConfig, text_lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in LLM states `[B, max(text_lens), D]` and a left-packed mask (sample i: text_lens[i] tokens)."""
    longest = max(text_lens)
    states, mask = text_condition(config.text_feat_dim, longest, seed, batch=len(text_lens))
    for i, length in enumerate(text_lens):
        mask[i, length:] = False
    return states, mask


def velocity_inputs(
    config: DiTConfig, height: int, width: int, text_lens: list[int], timestep: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = len(text_lens)
    latents = seeded_latents((batch, config.in_channels, height, width), seed)
    states, mask = text_inputs(config, text_lens, seed + 1000)
    return latents, torch.full((batch,), timestep, dtype=torch.float32), states, mask


def forward(adapter: Any, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The velocity; the fp64 golden gets the same inputs in fp64 (the adapters cast the rest)."""
    if getattr(adapter, "dtype", None) == torch.float64:
        inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    return adapter.forward(*inputs)


# ---------------------------------------------------------------------------------------------
# Block sites and compile bookkeeping
# ---------------------------------------------------------------------------------------------


def record_block_outputs(adapter: Any) -> tuple[dict[str, list[torch.Tensor]], list[Any]]:
    """Forward hooks on every `block_sites()` entry: site name -> outputs, one per call."""
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name, _ in adapter.block_sites()}
    handles = []
    for name, block in adapter.block_sites():
        hook = lambda _module, _args, out, name=name: outputs[name].append(out.detach())
        handles.append(block.register_forward_hook(hook))
    return outputs, handles


def block_codes(model: nn.Module, class_name: str) -> list[Any]:
    """The `forward` code objects of every submodule whose class is named `class_name`, in order.

    Counting these (and nothing else) is the per-code-object counter of vllm-project/vllm-omni#7455."""
    codes: dict[Any, None] = {}
    for module in model.modules():
        if type(module).__name__ == class_name:
            codes.setdefault(type(module).forward.__code__, None)
    return list(codes)


def block_class() -> str:
    return CASES["models"].block_class


def count_block_compiles(ledger: CompileLedger, codes: list[Any]) -> int:
    """Frames compiled for the block's `forward` code objects only, never all frames: library code
    compiles frames of its own, and an all-frames count passed with regional compile off
    (vllm-project/vllm-omni#7455). Suites call it through this module so a harness variant can replace it."""
    return sum(ledger.compiles(code) for code in codes)


def image_path(run_dir: Path, case: str, variant: str) -> Path:
    """`<run_dir>/images/<case>/<variant>.png`, where the review page looks for them (docs/reports.md §8).
    Both names are path components: a name that could leave the run directory is refused."""
    return run_dir / "images" / check_safe_name(case, "case") / f"{check_safe_name(variant, 'image variant')}.png"


# ---------------------------------------------------------------------------------------------
# Regional compile for the compiled-vs-eager checks (numerics, image)
# ---------------------------------------------------------------------------------------------

# The compiled-vs-eager checks exist for Inductor: its fused kernels (FMAs, reordered reductions)
# are what can move the numbers; a cheaper backend would compare eager with eager.
COMPARE_BACKEND = "inductor"
COMPILE, REGIONAL = requirement("compile_settings"), requirement("regional_compile")


def record_regional(report: Any, regional: Any, backend: str) -> bool:
    """The `regional_modules_compiled` gate row (>= 1); True when something was compiled."""
    (row,) = regional.rows()
    report.record(
        case="dit-regional-compile",
        metric="regional_modules_compiled",
        value=regional.count,
        threshold=1,
        verdict=row["verdict"],
        detail=f"{row['detail']}; {COMPILE.words}, backend={backend} ({REGIONAL.words}, {REGIONAL.cite}; {COMPILE.cite})",
        better=better_of("regional_modules_compiled"),
    )
    return regional.count >= 1


@contextlib.contextmanager
def compiled_for_comparison(report: Any, adapter: Any) -> Iterator[None]:
    """Inside: the target's repeated blocks regionally compiled with Inductor (fullgraph, dynamic).

    Writes the `regional_modules_compiled` row on entry and the `block_compiles` row on exit, and
    puts the eager forwards back whatever happens."""
    block = block_class()
    codes = block_codes(adapter.module, block)
    with CompileLedger() as ledger:
        regional = compile_repeated_blocks(adapter.module, dynamic=True, fullgraph=True, backend=COMPARE_BACKEND, ledger=ledger)
        try:
            record_regional(report, regional, COMPARE_BACKEND)
            yield
        finally:
            regional.restore()
    record_block_compiles(report, ledger, codes, f"{block}.forward")


def record_block_compiles(report: Any, ledger: CompileLedger, codes: list[Any], site: str) -> None:
    """Gate: the block's `forward` compiled at least once and its calls went through the compiled
    code, so a compiled-vs-eager comparison is not eager against eager (vllm-project/vllm-omni#7455)."""
    compiles = count_block_compiles(ledger, codes)
    calls = sum(ledger.calls(code) for code in codes)
    fallbacks = [fb for fb in ledger.eager_fallbacks() if fb.code in codes]
    ok = compiles >= 1 and calls >= 1 and not fallbacks
    report.record(
        case="dit-regional-compile",
        site=site,
        metric="block_compiles",
        value=compiles,
        threshold=1,
        verdict="pass" if ok else "fail",
        detail=f"{compiles} compiles of {site}, {calls} calls through the compiled forward, "
        f"{len(fallbacks)} recompile-limit fallbacks to eager (all frames compiled: {ledger.compiles()})",
        better=better_of("block_compiles"),
    )

"""Sampler: the target's flow-match schedule and sampling loop against the reference's, which is
the release's (docs/model.md §8), without the transformer in the way.

* Schedule (`[schedule]` of `cases/dit.toml`, every lane): at each (steps, latent h×w) point the
  target's `timesteps(steps, h, w)` against the reference's, bit for bit (gate `max_ulp` = 0,
  site `timesteps`), with the shift each implies (info `shift`). Square and non-square latents in
  both orientations: the shift depends on sqrt(h·w), so a port that reads one side is right on
  squares only, and an image suite on square latents would never see it.
* Loop (`[[sampler]]`): target and reference sample with their `module` swapped for one stand-in
  velocity, an elementwise function of the latents, the timestep and the first text token in the
  model dtype. Without transformer noise a loop that performs the release's operations in the
  release's dtypes (the float32 Euler sum, the latents back in the model dtype, CFG combined in
  the model dtype) reproduces the reference's bits whatever its batching, so the gates are exact:
  `cfg_trace` (which text the unconditional branch got at which steps: the CFG range latch and
  the negative prompt), `latents_dtype` (the model dtype, as the release returns them) and
  `mismatched_elements` = 0 over the final latents. A case's `dtype` is the loop's model dtype on
  every lane: bf16 is where the state between steps shows (fp32 state drifts by many bf16 ULPs
  over a few steps, while its effect on an image stays inside bf16 image noise).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from parity.compare import AT_MOST, count_rule, equality_rule
from parity.compare.diff import ulp_distance
from parity.suites.dit.support import CASES, TORCH_DTYPES, DiTModels, SamplerCase, require_size, text_inputs
from parity.suites.families import require_family
from reference_models.checkpoints import make_checkpoint
from reference_models.dit.adapter import ReferenceDiT

pytestmark = pytest.mark.parity_suite("sampler")

LATTICE = CASES["schedule"]
POINTS = [(steps, h, w) for steps in LATTICE.steps for h, w in LATTICE.sizes]


# ---------------------------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------------------------


def implied_shift(times: torch.Tensor) -> float | None:
    """The m of `t' = t / (m - m t + t)` a schedule implies (median over the interior points,
    fp64), or None with fewer than 3 times."""
    times = times.to(torch.float64)
    steps = times.numel() - 1
    shifts = []
    for i in range(1, steps):
        grid, t = i / steps, float(times[i])
        if 0.0 < t < 1.0:
            shifts.append(grid * (1.0 - t) / (t * (1.0 - grid)))
    return statistics.median(shifts) if shifts else None


def schedule_of(adapter: Any, steps: int, height: int, width: int) -> torch.Tensor:
    if not hasattr(adapter, "timesteps"):
        raise AttributeError(
            f"{adapter.name}: the DiT adapter has no timesteps(steps, height, width) returning its sampler's "
            "[steps + 1] float32 times (parity.target.DiTAdapter)"
        )
    return torch.as_tensor(adapter.timesteps(steps, height, width)).detach().cpu()


@pytest.mark.parametrize("point", POINTS, ids=[f"dit-schedule-{s}steps-{h}x{w}" for s, h, w in POINTS])
def test_schedule_matches_reference(point: tuple[int, int, int], dit_models: DiTModels, report: Any, settings: Any) -> None:
    steps, height, width = point
    report.case = f"dit-schedule-{steps}steps-{height}x{width}"
    report.seed = settings.seed
    expected = schedule_of(dit_models.reference, steps, height, width)
    got = schedule_of(dit_models.target, steps, height, width)
    shape = equality_rule(
        (tuple(got.shape), str(got.dtype)),
        (tuple(expected.shape), str(expected.dtype)),
        metric="timesteps_shape",
        detail="the N + 1 times t_0 .. t_N = 1 in float32",
    )
    if not shape.ok:
        report.verdict(shape, site="timesteps")
        return
    ulps = ulp_distance(expected, got, torch.float32)
    worst = int(ulps.max())
    differ = ulps.nonzero().flatten().tolist()
    where = "all bit-equal"
    if differ:
        i = differ[0]
        where = f"{len(differ)} of {ulps.numel()} differ, first t[{i}] = {got[i].item()!r} vs {expected[i].item()!r}"
    ref_shift, got_shift = implied_shift(expected), implied_shift(got)
    report.verdict(count_rule(worst, 0, metric="max_ulp", at=AT_MOST, detail=f"{where}; {LATTICE.reason}"), site="timesteps")
    if ref_shift is not None:
        report.info(
            metric="shift",
            value=got_shift,
            detail=f"target implies m = {got_shift!r}, reference m = {ref_shift!r} (sqrt({height}*{width})/40 = "
            f"{(height * width) ** 0.5 / 40!r})",
            site="timesteps",
        )


# ---------------------------------------------------------------------------------------------
# The loop around a stand-in velocity
# ---------------------------------------------------------------------------------------------


class StandInVelocity(nn.Module):
    """`v = -0.75 x + 0.5 t + e`, e the first text token's first C features (0 for empty text or a
    masked first token), all in the latents' dtype: elementwise per row, so a doubled CFG batch and
    batch-1 calls give the same bits. Records each call's rows as (timestep, text kind)."""

    def __init__(self, known_texts: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.known_texts = known_texts  # kind -> first-token features [C] in the model dtype
        self.calls: list[list[tuple[float, str]]] = []
        self.latent_dtypes: set[str] = set()

    def first_token(self, text_states: torch.Tensor, text_mask: torch.Tensor, channels: int, dtype: torch.dtype) -> torch.Tensor:
        batch = text_states.shape[0]
        if text_states.shape[1] == 0:
            return torch.zeros(batch, channels, dtype=dtype, device=text_states.device)
        if text_states.shape[2] < channels:
            raise ValueError(f"stand-in velocity: text width {text_states.shape[2]} < latent channels {channels}")
        keep = text_mask[:, :1].to(dtype)
        return text_states[:, 0, :channels].to(dtype) * keep

    def kind(self, features: torch.Tensor) -> str:
        if not bool(features.any()):
            return "empty"
        for name, known in self.known_texts.items():
            if torch.equal(features, known):
                return name
        return "other"

    def forward(
        self, latents: torch.Tensor, timestep: torch.Tensor, text_states: torch.Tensor, text_mask: torch.Tensor
    ) -> torch.Tensor:
        dtype, channels = latents.dtype, latents.shape[1]
        features = self.first_token(text_states, text_mask.to(torch.bool), channels, dtype)
        t = timestep.to(dtype).reshape(-1)
        self.latent_dtypes.add(str(dtype).removeprefix("torch."))
        self.calls.append([(float(t[row]), self.kind(features[row])) for row in range(latents.shape[0])])
        return latents * -0.75 + t[:, None, None, None] * 0.5 + features[:, :, None, None]

    def trace(self) -> list[tuple[str, ...]]:
        """Per step (consecutive calls with one timestep), the sorted text kinds the model saw."""
        steps: list[tuple[float, list[str]]] = []
        for rows in self.calls:
            for t, kind in rows:
                if not steps or steps[-1][0] != t:
                    steps.append((t, []))
                steps[-1][1].append(kind)
        return [tuple(sorted(kinds)) for _, kinds in steps]


def describe(trace: list[tuple[str, ...]]) -> str:
    """`steps 0-2: negative+prompt; steps 3-5: prompt` (runs of equal steps)."""
    if not trace:
        return "no model calls"
    parts, start = [], 0
    for i in range(1, len(trace) + 1):
        if i == len(trace) or trace[i] != trace[start]:
            span = f"step {start}" if i - 1 == start else f"steps {start}-{i - 1}"
            parts.append(f"{span}: {'+'.join(trace[start])}")
            start = i
    return "; ".join(parts)


@contextmanager
def stand_in(adapter: Any, stub: StandInVelocity) -> Iterator[StandInVelocity]:
    """`adapter.module` replaced by `stub` inside, put back whatever happens."""
    real = adapter.module
    adapter.module = stub
    try:
        yield stub
    finally:
        adapter.module = real


class SamplerAdapters:
    """Target and reference DiT adapters per model dtype, from one tiny checkpoint (the stand-in
    replaces the transformer, so the weights do not matter; the tiny ones load in milliseconds)."""

    def __init__(self, target: Any, settings: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.target, self.device = target, torch.device(settings.device)
        self.directory = make_checkpoint("dit", "tiny", settings.seed, tmp_path_factory.mktemp("dit-sampler"))
        self.built: dict[str, tuple[Any, ReferenceDiT]] = {}

    def get(self, dtype: str) -> tuple[Any, ReferenceDiT]:
        if dtype not in self.built:
            torch_dtype = TORCH_DTYPES[dtype]
            self.built[dtype] = (
                self.target.load_dit(self.directory, self.device, torch_dtype),
                ReferenceDiT.load(self.directory, self.device, torch_dtype),
            )
        return self.built[dtype]


@pytest.fixture(scope="session")
def sampler_adapters(target: Any, settings: Any, tmp_path_factory: pytest.TempPathFactory) -> SamplerAdapters:
    require_family(target, "dit")
    return SamplerAdapters(target, settings, tmp_path_factory)


def run_loop(adapter: Any, case: SamplerCase, seed_offset: int) -> tuple[torch.Tensor, StandInVelocity]:
    """The adapter's `sample` around a fresh stand-in: final latents (CPU) and the stand-in."""
    dtype, device = adapter.dtype, adapter.device
    states, mask = text_inputs(adapter.config, [case.text_len], case.text_seed + seed_offset)
    channels = adapter.config.in_channels
    known = {"prompt": states[0, 0, :channels]} if case.text_len else {}
    negative = {}
    if case.negative_len:
        negative_states, negative_mask = text_inputs(adapter.config, [case.negative_len], case.negative_seed + seed_offset)
        negative = {"negative_states": negative_states, "negative_mask": negative_mask}
        known["negative"] = negative_states[0, 0, :channels]
    stub = StandInVelocity({name: f.to(device, dtype) for name, f in known.items()})
    with stand_in(adapter, stub):
        latents = adapter.sample(
            states,
            mask,
            case.height,
            case.width,
            case.steps,
            case.guidance_scale,
            case.cfg_range,
            case.seed + seed_offset,
            **negative,
        )
    return latents.detach().cpu(), stub


@pytest.mark.parametrize("case", CASES["sampler"], ids=[c.name for c in CASES["sampler"]])
def test_sampling_loop_matches_reference(
    case: SamplerCase, sampler_adapters: SamplerAdapters, report: Any, settings: Any
) -> None:
    require_size("sampler", case, settings.size)
    report.case = case.name
    report.seed = case.seed + settings.seed
    target, reference = sampler_adapters.get(case.dtype)
    expected, ref_stub = run_loop(reference, case, settings.seed)
    got, target_stub = run_loop(target, case, settings.seed)

    ref_trace, got_trace = ref_stub.trace(), target_stub.trace()
    report.verdict(
        equality_rule(
            describe(got_trace),
            describe(ref_trace),
            metric="cfg_trace",
            detail=f"text the model saw per step, cfg_range {tuple(case.cfg_range)} guidance {case.guidance_scale:g} "
            "(the release drops guidance to 1 at the first step outside the range, for good; the negative prompt, "
            "or empty text, is the unconditional text)",
        ),
        site="loop",
    )
    seen = ", ".join(sorted(target_stub.latent_dtypes)) or "none"
    report.verdict(
        equality_rule(
            str(got.dtype).removeprefix("torch."),
            str(expected.dtype).removeprefix("torch."),
            metric="latents_dtype",
            detail=f"sample() returns the latents in the model dtype ({case.dtype}), the state the release keeps "
            f"between steps; the target's model saw latents in {seen}",
        ),
        site="latents",
    )
    if got.shape != expected.shape:
        raise AssertionError(f"{case.name}: target latents {tuple(got.shape)}, reference {tuple(expected.shape)}")
    mismatched = int((got.to(torch.float64) != expected.to(torch.float64)).sum())
    max_abs = float((got.to(torch.float64) - expected.to(torch.float64)).abs().max())
    ulps = int(ulp_distance(expected, got, expected.dtype).max())
    report.verdict(
        count_rule(
            mismatched,
            0,
            metric="mismatched_elements",
            at=AT_MOST,
            detail=f"{mismatched} of {got.numel()} latents differ, max abs {max_abs:.3g}, max {ulps} ULP of "
            f"{case.dtype}; bit-equal by construction: the stand-in velocity is elementwise, so the release's "
            "operations in the release's dtypes give the reference's bits (docs/model.md §8)",
        ),
        site="latents",
    )

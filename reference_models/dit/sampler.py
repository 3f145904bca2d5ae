"""Flow-matching Euler sampling schedule of the DiT stage, as the release runs it (docs/model.md §8).

t runs from 0 (noise) to 1 (data). The grid is numpy's float32 `linspace(0, 1, N+1)[:-1]` (each
value `i * (1/N)` in float64, then rounded to float32), shifted towards the noise end by
`m = sqrt(h·w)/40` for a latent grid of h×w (3.2 at 1024² pixels = 128² latents) with float32
arithmetic throughout (`m` rounded to float32 first, as numpy 1.26, the release's pin, promotes a
float64 scalar against a float32 array), and t = 1 appended. `torch.linspace` in float32 is not
this grid (1 ULP apart on about a quarter of the values), hence the explicit construction.

Text CFG uses the release's latch: the guidance scale in force at step i is the case's scale while
every step so far satisfied `cfg_range[0] <= i/N <= cfg_range[1]`, and 1.0 from the first step
outside the range on, for all later steps (the release overwrites its scale variable). A range
that does not start at 0 therefore switches CFG off for the whole run.
"""

from __future__ import annotations

import math

import torch


def time_shift(latent_height: int, latent_width: int) -> float:
    """`m = sqrt(latent_H · latent_W) / 40` (float64, correctly rounded like numpy's sqrt)."""
    return math.sqrt(latent_height * latent_width) / 40.0


def flow_match_timesteps(steps: int, latent_height: int, latent_width: int) -> torch.Tensor:
    """The N + 1 times `t_0 … t_N = 1` in float32, bit-equal to the release's numpy computation."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    # numpy's linspace: arange in float64 times the float64 step 1/N, then one rounding to float32.
    grid = (torch.arange(steps, dtype=torch.float64) * (1.0 / steps)).to(torch.float32)
    shift = torch.tensor(time_shift(latent_height, latent_width), dtype=torch.float32)
    shifted = grid / (shift - shift * grid + grid)
    return torch.cat([shifted, torch.ones(1, dtype=torch.float32)])


def guidance_scales(steps: int, guidance_scale: float, cfg_range: tuple[float, float]) -> list[float]:
    """The text guidance scale in force at each of the `steps` steps (the release's latch).

    At step i the scale becomes 1.0 when `i/N` is outside `cfg_range` and never comes back; CFG
    runs at the steps whose scale is above 1."""
    low, high = cfg_range
    scale = float(guidance_scale)
    scales = []
    for step in range(steps):
        if not low <= step / steps <= high:
            scale = 1.0
        scales.append(scale)
    return scales


def euler_step(latents: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor) -> torch.Tensor:
    """One Euler step the release's way, back in the latents' dtype.

    The state is upcast to float32 (kept for fp64 goldens), the float32 step size `t_next - t` (0-dim)
    multiplies the velocity in the velocity's dtype (PyTorch promotion: a 0-dim float tensor does not
    widen a bf16 one), the sum is in float32 and the result is rounded to the model dtype, which is
    what the latents carry between steps."""
    upcast = latents.to(torch.promote_types(latents.dtype, torch.float32))
    return (upcast + (t_next - t) * velocity).to(latents.dtype)


def initial_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Seeded standard normal latents, drawn in fp32 on the CPU so every device starts equal
    (the sampler rounds them to the model dtype)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def text_condition(text_dim: int, length: int, seed: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic stand-in LLM text states `[batch, length, text_dim]` (fp32, CPU) and an
    all-true mask, for tests and suites (negative prompts too)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    states = torch.randn(batch, length, text_dim, generator=generator, dtype=torch.float32)
    return states, torch.ones(batch, length, dtype=torch.bool)

"""The serving port's flow-matching Euler schedule (docs/model.md §8) and seeded inputs.

t runs 0 (noise) → 1 (data). The release computes its grid with numpy (`linspace` in float64,
rounded once to float32) and the shift `t ← t / (m − m·t + t)`, `m = sqrt(h·w)/40`, in float32;
this port builds the same float32 values with torch (not `torch.linspace`, whose float32 grid is
1 ULP off on about a quarter of the values). Guidance follows the release's latch: from the first
step whose `i/N` is outside `cfg_range` on, the scale is 1.0 for the rest of the run.
"""

from __future__ import annotations

import math

import torch


def flow_match_timesteps(steps: int, latent_height: int, latent_width: int) -> torch.Tensor:
    """`[steps + 1]` float32 times, t_N = 1, for a latent grid of `latent_height`×`latent_width`."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    index = torch.arange(steps, dtype=torch.float64)
    t = (index * (1.0 / steps)).to(torch.float32)
    m = torch.tensor(math.sqrt(latent_height * latent_width) / 40.0, dtype=torch.float32)
    t = t / (m - m * t + t)
    return torch.cat([t, torch.ones(1, dtype=torch.float32)])


def guidance_per_step(steps: int, guidance_scale: float, cfg_range: tuple[float, float]) -> list[float]:
    """Scale per step; 1.0 from the first step outside `cfg_range` to the end (the release's latch)."""
    out: list[float] = []
    in_range = True
    for i in range(steps):
        in_range = in_range and cfg_range[0] <= i / steps <= cfg_range[1]
        out.append(float(guidance_scale) if in_range else 1.0)
    return out


def euler_update(x: torch.Tensor, v: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor) -> torch.Tensor:
    """`x + (t1 - t0)·v` summed in at least float32 (the step times the velocity in v's dtype) and
    returned in x's dtype: the model dtype is the state between steps, as in the release."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return (x.to(acc) + (t1 - t0) * v).to(x.dtype)


def initial_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Seeded fp32 normal drawn on the CPU (device-independent start)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def text_condition(text_dim: int, length: int, seed: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded stand-in LLM text states (fp32, CPU) and an all-true mask."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    states = torch.randn(batch, length, text_dim, generator=generator, dtype=torch.float32)
    return states, torch.ones(batch, length, dtype=torch.bool)

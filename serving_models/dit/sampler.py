"""The serving port's flow-matching Euler schedule (docs/model.md §8) and seeded inputs.

t runs 0 (noise) → 1 (data): `t = linspace(0, 1, N+1)[:-1]`, shifted by `m = sqrt(h·w)/40` for an
h×w latent grid (`t ← t / (m − m·t + t)`), then t = 1 appended. CFG applies at step i when the
scale is above 1 and `cfg_range[0] <= i/N <= cfg_range[1]`.
"""

from __future__ import annotations

import math

import torch


def flow_match_timesteps(steps: int, latent_height: int, latent_width: int) -> torch.Tensor:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    t = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float32)[:-1]
    m = math.sqrt(latent_height * latent_width) / 40.0
    t = t / (m - m * t + t)
    return torch.cat([t, torch.ones(1, dtype=torch.float32)])


def cfg_active(step: int, steps: int, guidance_scale: float, cfg_range: tuple[float, float]) -> bool:
    return guidance_scale > 1.0 and cfg_range[0] <= step / steps <= cfg_range[1]


def initial_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Seeded fp32 normal drawn on the CPU (device-independent start)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def text_condition(text_dim: int, length: int, seed: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded stand-in LLM text states (fp32, CPU) and an all-true mask."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    states = torch.randn(batch, length, text_dim, generator=generator, dtype=torch.float32)
    return states, torch.ones(batch, length, dtype=torch.bool)

"""Flow-matching Euler sampling schedule of the DiT stage (docs/model.md §8).

`FlowMatchEulerDiscreteScheduler(dynamic_time_shift=True)`: t runs from 0 (noise) to 1 (data);
the grid `linspace(0, 1, N+1)[:-1]` is shifted towards the noise end by `m = sqrt(h·w)/40` for a
latent grid of h×w (3.2 at 1024² pixels = 128² latents), and t = 1 is appended. Text CFG applies
at step i when the scale is above 1 and `cfg_range[0] <= i/N <= cfg_range[1]`.
"""

from __future__ import annotations

import math

import torch


def time_shift(latent_height: int, latent_width: int) -> float:
    """`m = sqrt(latent_H · latent_W) / 40`."""
    return math.sqrt(latent_height * latent_width) / 40.0


def flow_match_timesteps(steps: int, latent_height: int, latent_width: int) -> torch.Tensor:
    """The N + 1 times `t_0 … t_N = 1` (fp32, as the upstream scheduler builds them)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    t = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float32)[:-1]
    m = time_shift(latent_height, latent_width)
    t = t / (m - m * t + t)
    return torch.cat([t, torch.ones(1, dtype=torch.float32)])


def cfg_active(step: int, steps: int, guidance_scale: float, cfg_range: tuple[float, float]) -> bool:
    """Whether step `step` of `steps` runs the unconditional pass."""
    return guidance_scale > 1.0 and cfg_range[0] <= step / steps <= cfg_range[1]


def initial_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Seeded standard normal latents, drawn in fp32 on the CPU so every device starts equal."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def text_condition(text_dim: int, length: int, seed: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic stand-in LLM text states `[batch, length, text_dim]` (fp32, CPU) and an
    all-true mask, for tests and suites."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    states = torch.randn(batch, length, text_dim, generator=generator, dtype=torch.float32)
    return states, torch.ones(batch, length, dtype=torch.bool)

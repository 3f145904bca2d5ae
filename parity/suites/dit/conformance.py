"""The DiT family's conformance probe: every `DiTAdapter` member the DiT suites call, once on a tiny
input (one velocity, the schedule, one sampling step, one decode), with its types and shapes
(docs/targets.md §6)."""

from __future__ import annotations

from typing import Any

import torch

from parity.conformance import Checks, shape_text
from parity.localise.families.dit import JOINT_LAYOUTS, block_counts
from parity.localise.validate import stage_map_report
from parity.suites.families import probe_loaders
from parity.target import DiTAdapter
from reference_models.dit.checkpoint import random_state_dict
from reference_models.dit.config import config_for_size


def probe(target: Any, device: str) -> list[str]:
    config = config_for_size("tiny")
    checks = Checks("DiT adapter")
    state = random_state_dict(config, 0, device, torch.float32)
    loaded = probe_loaders(
        checks, target, "dit", DiTAdapter, config=config, state=state, device=device, expected="a DiT adapter, docs/targets.md §6"
    )
    if loaded is None:
        return checks.done()
    adapter, _, _ = loaded
    checks.expect(
        isinstance(adapter.module, torch.nn.Module),
        f"module must be the DiT nn.Module (regional compile and the sampler's stand-in use it), got {type(adapter.module).__name__}",
        "module is an nn.Module",
    )
    problems, checked = stage_map_report(adapter, "dit", block_counts(config))
    checks.problems += problems
    checks.checked += [checked] if checked else []
    layout = getattr(adapter, "joint_layout", None)
    checks.expect(
        layout is None or layout in JOINT_LAYOUTS,
        f"joint_layout must be one of {', '.join(JOINT_LAYOUTS)} (or absent), got {layout!r}",
        f"joint_layout {layout}"
        if layout
        else "no joint_layout: a padded velocity case compares the tokens every layout places alike",
    )
    condition = checks.attempt("text_condition(4, seed=0)", lambda: adapter.text_condition(4, 0))
    if not checks.expect(
        isinstance(condition, tuple) and len(condition) == 2,
        f"text_condition must return (states, mask), got {type(condition).__name__}",
    ):
        return checks.done()
    states, mask = condition
    if not checks.expect(
        isinstance(states, torch.Tensor)
        and states.ndim == 3
        and states.shape[:2] == (1, 4)
        and isinstance(mask, torch.Tensor)
        and tuple(mask.shape) == (1, 4),
        f"text_condition(4, seed=0) must return (states [1, 4, F], mask [1, 4]), got ({shape_text(states)}, {shape_text(mask)})",
        "text_condition -> (states [1, 4, F], mask [1, 4])",
    ):
        return checks.done()
    latents = torch.zeros(1, config.in_channels, 8, 8, device=device)
    timestep = torch.full((1,), 0.5, device=device)
    velocity = checks.attempt(
        "forward(latents, timestep, text_states, text_mask)", lambda: adapter.forward(latents, timestep, states, mask)
    )
    checks.expect(
        isinstance(velocity, torch.Tensor) and velocity.shape == latents.shape,
        f"forward must return a velocity shaped like the latents {list(latents.shape)}, got {shape_text(velocity)}",
        f"forward -> {list(latents.shape)}",
    )
    schedule = checks.attempt("timesteps(2, 8, 8)", lambda: torch.as_tensor(adapter.timesteps(2, 8, 8)))
    checks.expect(
        isinstance(schedule, torch.Tensor) and tuple(schedule.shape) == (3,) and schedule.is_floating_point(),
        f"timesteps(steps=2, 8, 8) must return the sampler's [steps + 1] float times, got {shape_text(schedule)}",
        "timesteps -> [3]",
    )
    sampled = checks.attempt(
        "sample(states, mask, 8, 8, steps=1, guidance_scale=1.0, cfg_range=(0.0, 1.0), seed=0)",
        lambda: adapter.sample(states, mask, 8, 8, 1, 1.0, (0.0, 1.0), 0),
    )
    if checks.expect(
        isinstance(sampled, torch.Tensor) and sampled.shape == latents.shape,
        f"sample(..., height 8, width 8, ...) must return latents {list(latents.shape)}, got {shape_text(sampled)}",
        f"sample -> {list(latents.shape)}",
    ):
        images = checks.attempt("decode(latents)", lambda: adapter.decode(sampled))
        checks.expect(
            isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and images.ndim == 4 and images.shape[::3] == (1, 3),
            f"decode(latents [1, C, 8, 8]) must return uint8 images [1, H, W, 3], got {shape_text(images)} {getattr(images, 'dtype', '')}",
            f"decode -> uint8 {list(getattr(images, 'shape', []))}",
        )
    sites = checks.attempt("block_sites()", adapter.block_sites) or []
    checks.expect(
        len(sites) > 0 and all(isinstance(s, tuple) and len(s) == 2 and isinstance(s[1], torch.nn.Module) for s in sites),
        "block_sites() must list (name, nn.Module) pairs in execution order",
        f"block_sites() {len(sites)} blocks",
    )
    return checks.done()

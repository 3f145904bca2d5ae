"""The DiT family's conformance probe: every `DiTAdapter` member, and one velocity on a tiny input."""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from parity.conformance import Checks, shape_text
from parity.target import DiTAdapter
from reference_models.checkpoints import make_checkpoint
from reference_models.dit.checkpoint import random_state_dict
from reference_models.dit.config import config_for_size


def probe(target: Any, device: str) -> list[str]:
    config = config_for_size("tiny")
    checks = Checks("DiT adapter")
    with tempfile.TemporaryDirectory(prefix="parity-conformance-") as directory:
        make_checkpoint("dit", "tiny", 0, directory)
        adapter = checks.attempt(
            "target.load_dit(tiny checkpoint, device, float32)", lambda: target.load_dit(directory, device, torch.float32)
        )
    state = random_state_dict(config, 0, device, torch.float32)
    built = checks.attempt(
        "target.build_dit(config, state_dict, device, float32)", lambda: target.build_dit(config, state, device, torch.float32)
    )
    if adapter is None or built is None or not checks.require(adapter, DiTAdapter, "DiT adapter"):
        return checks.done()
    checks.what = f"DiT adapter {type(adapter).__name__}"
    condition = checks.attempt("text_condition(4, seed=0)", lambda: adapter.text_condition(4, 0))
    if not checks.expect(
        isinstance(condition, tuple) and len(condition) == 2,
        f"text_condition must return (states, mask), got {type(condition).__name__}",
    ):
        return checks.done()
    states, mask = condition
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
    sites = checks.attempt("block_sites()", adapter.block_sites) or []
    checks.expect(
        len(sites) > 0 and all(isinstance(s, tuple) and len(s) == 2 and isinstance(s[1], torch.nn.Module) for s in sites),
        "block_sites() must list (name, nn.Module) pairs in execution order",
        f"block_sites() {len(sites)} blocks",
    )
    return checks.done()

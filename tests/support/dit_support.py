"""Shared builders for the DiT tests (imported by tests/test_dit_*.py; not a test module)."""

from __future__ import annotations

import functools

import torch

from reference_models.dit.adapter import ReferenceDiT
from reference_models.dit.checkpoint import random_state_dict
from reference_models.dit.config import DiTConfig, tiny_config
from serving_models.dit.adapter import ServingDiT

SEED = 0


@functools.lru_cache(maxsize=4)
def tiny_state(seed: int = SEED) -> dict[str, torch.Tensor]:
    return random_state_dict(tiny_config(), seed)


def tiny_pair(dtype: torch.dtype = torch.float32, seed: int = SEED) -> tuple[ReferenceDiT, ServingDiT]:
    """Reference and serving adapters built from the same tiny weights."""
    config: DiTConfig = tiny_config()
    state = tiny_state(seed)
    return ReferenceDiT.build(config, state, dtype=dtype), ServingDiT.build(config, state, dtype=dtype)


def latents(shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def record_block_outputs(adapter) -> tuple[dict[str, list[torch.Tensor]], list]:
    """Forward hooks on every block site: name -> list of outputs (one per call)."""
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name, _ in adapter.block_sites()}
    handles = []
    for name, block in adapter.block_sites():
        handles.append(block.register_forward_hook(lambda _m, _a, out, name=name: outputs[name].append(out.detach())))
    return outputs, handles

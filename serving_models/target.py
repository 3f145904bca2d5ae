"""The built-in target: the serving-style implementations, behind the adapters the suites call.

`make_target()` is what `--target serving` resolves to (see `parity.target`); a tensor-parallel
run (`--tp N`) calls `make_target(tp=...)` on every rank and gets the sharded AR backbone
(`serving_models/ar/sharded.py`), the only family this port shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from serving_models.ar.adapter import ServingARAdapter
from serving_models.common import capture
from serving_models.dit import adapter as dit_adapter
from serving_models.routing import adapter as routing_adapter


class ServingTarget:
    """Serving AR backbone, serving DiT, serving router; owns the capture-probe registry."""

    name = "serving"
    capture = capture

    def load_ar(self, checkpoint_dir: str | Path, device: torch.device | str, dtype: torch.dtype) -> ServingARAdapter:
        return ServingARAdapter.load(checkpoint_dir, device, dtype)

    def build_ar(self, config: object, state_dict: Mapping[str, torch.Tensor], device, dtype) -> ServingARAdapter:
        return ServingARAdapter.build(config, state_dict, device, dtype)

    def load_dit(self, checkpoint_dir: str | Path, device: torch.device | str, dtype: torch.dtype):
        return dit_adapter.load(checkpoint_dir, device, dtype)

    def build_dit(self, config: object, state_dict: Mapping[str, torch.Tensor], device, dtype):
        return dit_adapter.build(config, state_dict, device, dtype)

    def router(self) -> routing_adapter.ServingRouter:
        return routing_adapter.make_router()


class ShardedServingTarget:
    """The serving AR backbone, tensor-parallel over the run's process group (this rank's shard)."""

    capture = capture

    def __init__(self, tp) -> None:
        self.tp = tp
        self.name = f"serving-tp{tp.world_size}"

    def load_ar(self, checkpoint_dir: str | Path, device: torch.device | str, dtype: torch.dtype):
        from serving_models.ar.sharded_adapter import ShardedARAdapter

        return ShardedARAdapter.load(checkpoint_dir, self.tp, device, dtype)

    def build_ar(self, config: object, state_dict: Mapping[str, torch.Tensor], device, dtype):
        from serving_models.ar.sharded_adapter import ShardedARAdapter

        return ShardedARAdapter.build(config, state_dict, self.tp, device, dtype)


def make_target(tp=None) -> ServingTarget | ShardedServingTarget:
    """`tp`: this rank's `TensorParallel` in a sharded run (None: one process)."""
    return ServingTarget() if tp is None else ShardedServingTarget(tp)

"""The reference as a target: `--target reference` runs the suites against the truth itself.

Such a run passes trivially where it can run at all; it checks the harness and the case tables,
not an implementation. The reference reads masks on the host, so graph modes do not apply to it
(its adapters say `supports_capture = False` and the suites skip those modes with that reason).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from reference_models.ar.adapter import ReferenceARAdapter
from reference_models.common import capture
from reference_models.dit import adapter as dit_adapter
from reference_models.routing import adapter as routing_adapter


class ReferenceTarget:
    name = "reference"
    capture = capture

    def load_ar(self, checkpoint_dir: str | Path, device: torch.device | str, dtype: torch.dtype) -> ReferenceARAdapter:
        return ReferenceARAdapter.load(checkpoint_dir, device, dtype)

    def build_ar(self, config: object, state_dict: Mapping[str, torch.Tensor], device, dtype) -> ReferenceARAdapter:
        return ReferenceARAdapter.build(config, state_dict, device, dtype)

    def load_dit(self, checkpoint_dir: str | Path, device: torch.device | str, dtype: torch.dtype):
        return dit_adapter.load(checkpoint_dir, device, dtype)

    def build_dit(self, config: object, state_dict: Mapping[str, torch.Tensor], device, dtype):
        return dit_adapter.build(config, state_dict, device, dtype)

    def router(self) -> routing_adapter.ReferenceRouter:
        return routing_adapter.make_router()


def make_target() -> ReferenceTarget:
    return ReferenceTarget()

"""Known-bad decode variants for the decode suite's tests (imported by tests; not collected).

`position_saturated_from(adapter, p)` wraps an AR adapter's decode step so that its position
saturates at `p - 1`: from decode position `p` on, every token overwrites KV slot `p - 1` and gets
that slot's RoPE angle, as a position clamped at a capacity or block boundary would. Every step
before `p` is exact, so the defect shows in the step logits only from the step that decodes
position `p` on (decoding position `L + i - 1` gives step `i`'s logits for a prompt of length L).
`late_decode_defect` is the same as a `--target` factory, for a suite run in a fresh process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from serving_models.target import ServingTarget

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The longest decode-case prompt (cases/ar.toml) has 8 tokens: position 17 is decoded at step 10
# for it and later for the shorter ones, so the defect is invisible in steps 0-9 of every case.
FIRST_BAD_POSITION = 17


def position_saturated_from(adapter: Any, first_bad_position: int) -> StepFn:
    """`adapter.decode_step` with positions clamped to `first_bad_position - 1` (graph-capturable:
    the clamp is a tensor op, so a captured graph holds it)."""
    inner = adapter.decode_step

    def decode_step(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return inner(input_ids, positions.clamp(max=first_bad_position - 1))

    return decode_step


class LateDecodeDefectTarget(ServingTarget):
    """The serving target whose AR decode position saturates from `FIRST_BAD_POSITION` on."""

    name = "serving-late-decode-defect"

    def load_ar(self, checkpoint_dir: str | Path, device: torch.device | str, dtype: torch.dtype) -> Any:
        return self._broken(super().load_ar(checkpoint_dir, device, dtype))

    def build_ar(self, config: object, state_dict: Mapping[str, torch.Tensor], device: Any, dtype: Any) -> Any:
        return self._broken(super().build_ar(config, state_dict, device, dtype))

    @staticmethod
    def _broken(adapter: Any) -> Any:
        adapter.decode_step = position_saturated_from(adapter, FIRST_BAD_POSITION)
        return adapter


def late_decode_defect() -> LateDecodeDefectTarget:
    return LateDecodeDefectTarget()

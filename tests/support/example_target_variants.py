"""Broken variants of the example engine target (examples/engine_target), as `--parity-target` factories."""

from __future__ import annotations

from typing import Any


def make_target_mask_past_start() -> Any:
    """The porter's planted bug: the gen mask as `id > start`, so the first gen id takes the und expert."""
    from examples.engine_target import engine, parity_target

    engine.derive_gen_token_mask = lambda input_ids, start: input_ids > start
    return parity_target.make_target()


def make_target_without_greedy_generate() -> Any:
    """A target whose AR adapter lacks a member of the contract (for `parity check-target`)."""
    from examples.engine_target import parity_target

    class Incomplete(parity_target.EngineARAdapter):
        def __getattribute__(self, name: str) -> Any:
            if name == "greedy_generate":
                raise AttributeError(name)
            return super().__getattribute__(name)

    class Target(parity_target.EngineTarget):
        def load_ar(self, checkpoint_dir, device, dtype):
            adapter = super().load_ar(checkpoint_dir, device, dtype)
            adapter.__class__ = Incomplete
            return adapter

    return Target()

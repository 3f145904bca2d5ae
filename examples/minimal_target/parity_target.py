"""The smallest target: an engine whose AR model class already speaks the adapter surface.

`parity run --target examples.minimal_target.parity_target:make_target` (with this repository's
root on `PYTHONPATH`). Where `examples/engine_target/` translates an engine's own forward signature
into parity's calls, this engine's adapter (here the built-in serving port's, standing in for an
engine that was written against docs/targets.md §3) needs nothing translated: the target is a name,
the engine's capture-probe registry and the two AR loaders. It provides only the AR family, so the
run leaves the DiT, routing and mutant-catalogue suites out with one line each (docs/targets.md §8).
"""

from __future__ import annotations

from serving_models.ar.adapter import ServingARAdapter
from serving_models.common import capture


class MinimalARTarget:
    name = "minimal-ar"
    capture = capture  # the registry the engine's model asks `is_capturing` (docs/targets.md §2.1)

    def load_ar(self, checkpoint_dir, device, dtype) -> ServingARAdapter:
        return ServingARAdapter.load(checkpoint_dir, device, dtype)

    def build_ar(self, config, state_dict, device, dtype) -> ServingARAdapter:
        return ServingARAdapter.build(config, state_dict, device, dtype)


def make_target() -> MinimalARTarget:
    return MinimalARTarget()

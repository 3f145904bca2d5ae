"""A model that never holds all its weights: each unit's weights are on the device only for that unit's forward.

The module is built on the meta device (shapes, no storage). A forward pre-hook on each unit (an
embedding table, a decoder layer, a head) asks a weight source for the unit's tensors by their
state-dict names and puts them in place; a forward hook puts the meta tensors back, so the
device's allocator can reuse the memory for the next unit (docs/lanes.md §4). The model's own
`forward` runs unchanged: the ops, their order and the weights are those of the whole model, so
the outputs are bit-identical to it wherever the source gives the same tensors.

Hooks registered later (the stage taps of docs/localise.md) run after the weights are in place
and see the same modules they would see on the whole model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

# names -> the tensors under those state-dict names, on the device and in the dtype of the forward
WeightSource = Callable[[Sequence[str]], Mapping[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Unit:
    """One streamed unit: its module path and the state-dict names of its parameters."""

    path: str
    names: tuple[str, ...]
    numel: int


class StreamedWeights:
    """Bring each unit's weights from `source` before its forward and release them after it.

    `units` are module paths of `module` whose parameters, together, are every parameter of
    `module` exactly once (checked here: a parameter outside every unit would stay on meta and
    fail inside the forward, far from its cause). `brought` holds the units whose weights are on
    the device now (none between forwards); `peak_units` the most at once (1 for disjoint units)."""

    def __init__(self, module: nn.Module, units: Sequence[str], source: WeightSource) -> None:
        self.module, self.source = module, source
        self.units = tuple(self._unit(path) for path in units)
        covered = [name for unit in self.units for name in unit.names]
        every = [name for name, _ in module.named_parameters()]
        if sorted(covered) != sorted(every):
            missing = sorted(set(every) - set(covered))
            twice = sorted({name for name in covered if covered.count(name) > 1})
            raise ValueError(f"streamed units must hold every parameter once: not in a unit {missing[:5]}, in two {twice[:5]}")
        self._meta = dict(module.named_parameters())
        self.brought: set[str] = set()  # paths of the units whose weights are on the device now
        self.peak_units = 0
        self.handles = []
        for unit in self.units:
            owner = module.get_submodule(unit.path)
            self.handles.append(owner.register_forward_pre_hook(lambda *_, unit=unit: self._bring(unit)))
            self.handles.append(owner.register_forward_hook(lambda *_, unit=unit: self._release(unit), always_call=True))

    def _unit(self, path: str) -> Unit:
        owner = self.module.get_submodule(path)
        params = list(owner.named_parameters())
        prefix = f"{path}." if path else ""
        return Unit(path, tuple(prefix + name for name, _ in params), sum(p.numel() for _, p in params))

    def _place(self, name: str, tensor: torch.Tensor) -> None:
        owner_path, _, attr = name.rpartition(".")
        owner = self.module.get_submodule(owner_path)
        owner._parameters[attr] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)

    def _bring(self, unit: Unit) -> None:
        tensors = self.source(unit.names)
        for name in unit.names:
            want, got = self._meta[name], tensors[name]
            if tuple(got.shape) != tuple(want.shape):
                raise ValueError(
                    f"streamed weight {name}: the source gave shape {tuple(got.shape)}, the module wants {tuple(want.shape)}"
                )
            self._place(name, got)
        self.brought.add(unit.path)
        self.peak_units = max(self.peak_units, len(self.brought))

    def _release(self, unit: Unit) -> None:
        """Put the meta tensors back (also after a forward that raised: `always_call`)."""
        for name in unit.names:
            self._place(name, self._meta[name])
        self.brought.discard(unit.path)

    @property
    def largest(self) -> Unit:
        return max(self.units, key=lambda unit: unit.numel)

    def remove(self) -> None:
        """Take the hooks off (the module keeps its meta weights)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

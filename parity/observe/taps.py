"""Taps: what a tapped module received and returned, on every call, in every execution mode.

A suite cannot ask a replayed CUDA graph which MoE expert it used: no Python runs during a replay.
So the runner records taps as *values the call produces*. Forward hooks copy each tapped module's
first positional input and its output into a store; in eager that is the whole story, and the
graph modes call the hooks once while recording and return the stored tensors as extra outputs
of the recorded function, so every replay hands back fresh tap values. `torch.compile` traces the
hooks' side effects, so the compiled mode gets the same values from the same hooks.

Hooks stay registered for the life of a prepared run (adding and removing them per call would
change what Dynamo guards on and recompile every call); `TapSet.remove()` takes them off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class TapCall:
    """One call of a tapped module: its first input (positional, else first keyword; None if
    neither) and its output (any structure of tensors, copied)."""

    input: Any
    output: Any


Taps = dict[str, list[TapCall]]


def _detached_copy(value: Any) -> Any:
    # A copy, not a reference: a later in-place op (a residual `add_`, a static buffer's next
    # copy-in) must not rewrite what the tap saw.
    return pytree.tree_map(lambda leaf: leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf, value)


class TapSet:
    """Forward hooks on named modules writing into one store; `snapshot()` returns a call's taps."""

    def __init__(self, modules: Mapping[str, nn.Module] | None) -> None:
        self.names: tuple[str, ...] = tuple(modules or {})
        self._store: dict[str, list[tuple[Any, Any]]] = {name: [] for name in self.names}
        self._handles = []
        for name, module in (modules or {}).items():
            if not isinstance(module, nn.Module):
                raise TypeError(f"tap {name!r}: expected an nn.Module, got {type(module).__name__}")
            self._handles.append(module.register_forward_hook(self._hook_for(name), with_kwargs=True))

    def _hook_for(self, name: str):
        store = self._store[name]

        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            # The first positional argument; a module called with keywords only gives its first one.
            first = args[0] if args else next(iter(kwargs.values()), None)
            store.append((_detached_copy(first), _detached_copy(output)))

        return record

    def clear(self) -> None:
        """Empty the store in place (the hooks hold references to its lists)."""
        for calls in self._store.values():
            calls.clear()

    def raw(self) -> dict[str, list[tuple[Any, Any]]]:
        """The store as plain containers of tensors: what a recorded function returns."""
        return {name: list(calls) for name, calls in self._store.items()}

    @staticmethod
    def as_taps(raw: Mapping[str, list[tuple[Any, Any]]]) -> Taps:
        return {name: [TapCall(i, o) for i, o in calls] for name, calls in raw.items()}

    def snapshot(self) -> Taps:
        return self.as_taps(self._store)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

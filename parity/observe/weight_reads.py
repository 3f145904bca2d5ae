"""Checkpoint directories and weight coverage: which checkpoint tensors a forward actually read.

A serving port can load every tensor of a checkpoint and still never use some of them: the
MammothModa2 generation expert shipped 42 `gen_mlp.*` tensors that loaded cleanly and were never
called (vllm-project/vllm-omni#9764). Loading checks cannot see that; watching the forward can. `WeightReads`
is a `TorchDispatchMode` that records every parameter whose storage an aten op touches, and a name
map attributes each parameter to the checkpoint tensors it was loaded from (a fused `gate_up_proj`
reads both `gate_proj` and `up_proj`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

NameMap = Callable[[str], Iterable[str]]


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as an HF-style safetensors checkpoint."""


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str


def checkpoint_files(checkpoint_dir: str | Path) -> list[Path]:
    """The safetensors files of a directory: the single file, or the shards its index names."""
    root = Path(checkpoint_dir)
    if (root / INDEX_FILE).exists():
        try:
            weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{root / INDEX_FILE}: not a safetensors index ({exc})") from exc
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (root / f).exists()]
        if missing:
            raise CheckpointError(f"{root / INDEX_FILE} names shards that do not exist: {missing}")
        return [root / f for f in files]
    if (root / SINGLE_FILE).exists():
        return [root / SINGLE_FILE]
    raise CheckpointError(f"{root}: no {SINGLE_FILE} and no {INDEX_FILE}")


def list_tensors(checkpoint_dir: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of a checkpoint with its shape and dtype, read from headers only."""
    entries: dict[str, TensorEntry] = {}
    for path in checkpoint_files(checkpoint_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                info = handle.get_slice(name)
                entries[name] = TensorEntry(name, tuple(info.get_shape()), info.get_dtype(), path.name)
    return entries


def _storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    try:  # tensor subclasses without real storage (a collective's pending result) are never weights
        return (tensor.device.type, tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


class WeightReads(TorchDispatchMode):
    """Records which watched parameters any aten op reads while the mode is active.

    Identity is by storage, so views (`weight.t()`, slices of a fused weight) count as reads of
    the parameter they view.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.by_storage: dict[tuple[str, int], list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            key = _storage_key(param)
            if key is not None and param.numel() > 0:
                self.by_storage.setdefault(key, []).append(name)
        self.read: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for leaf in tree_leaves((args, kwargs or {})):
            if isinstance(leaf, torch.Tensor):
                key = _storage_key(leaf)
                names = self.by_storage.get(key) if key is not None else None
                if names:
                    self.read.update(names)
        return func(*args, **(kwargs or {}))


def identity_names(parameter: str) -> list[str]:
    """Name map of a model whose parameter names are the checkpoint's (the reference)."""
    return [parameter]


@dataclasses.dataclass(frozen=True)
class Coverage:
    """Which checkpoint tensors the observed calls read, and which they never touched."""

    checkpoint: tuple[str, ...]
    read: frozenset[str]
    unattributed: tuple[str, ...]  # parameters read whose name map points outside the checkpoint

    @property
    def unused(self) -> list[str]:
        return [name for name in self.checkpoint if name not in self.read]

    @property
    def fraction(self) -> float:
        return 1.0 if not self.checkpoint else 1 - len(self.unused) / len(self.checkpoint)


def coverage(
    module: torch.nn.Module,
    checkpoint_names: Iterable[str],
    calls: Iterable[Callable[[], Any]],
    name_map: NameMap = identity_names,
) -> Coverage:
    """Run `calls` under `WeightReads` and attribute the parameters they read to checkpoint names."""
    names = tuple(checkpoint_names)
    known = set(names)
    recorder = WeightReads(module)
    with torch.no_grad(), recorder:
        for call in calls:
            call()
    read: set[str] = set()
    unattributed = []
    for parameter in sorted(recorder.read):
        targets = list(name_map(parameter))
        outside = [t for t in targets if t not in known]
        if outside or not targets:
            unattributed.append(parameter)
        read.update(t for t in targets if t in known)
    return Coverage(names, frozenset(read), tuple(unattributed))


def group_by_prefix(names: Iterable[str], depth: int = 4) -> Mapping[str, int]:
    """Count names per dotted prefix (`model.layers.14.gen_mlp`): a readable summary of a gap."""
    counts: dict[str, int] = {}
    for name in names:
        prefix = ".".join(name.split(".")[:depth])
        counts[prefix] = counts.get(prefix, 0) + 1
    return counts

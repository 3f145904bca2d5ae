"""The serving engine's checkpoint reader/writer: HF-style safetensors directories.

Single file (`model.safetensors`) or shards listed in `model.safetensors.index.json`. A serving
engine owns its loader, so this does not import the reference's; the file layout is the one
`transformers` writes. `WeightMismatchError` names every missing, unexpected and wrong-shaped
checkpoint tensor in one error line; a file that is not what it should be (`config.json` that is
not a JSON object, a safetensors file cut short, an integer weight) is a `CheckpointFileError`
line naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightMismatchError(ValueError):
    def __init__(
        self,
        source: str,
        missing: list[str],
        unexpected: list[str],
        wrong_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        self.source, self.missing, self.unexpected, self.wrong_shape = source, missing, unexpected, wrong_shape
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): " + ", ".join(missing))
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): " + ", ".join(unexpected))
        parts += [f"wrong shape: {n}: expected {list(e)}, got {list(g)}" for n, e, g in wrong_shape]
        super().__init__(f"{source}: checkpoint does not match the serving model: " + "; ".join(parts))


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be read as what it should be; one line naming the file."""


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A JSON file holding an object (`config.json`, the shard index), or one line naming the file
    and what is wrong: missing, not UTF-8, not JSON, not an object."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found") from None
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointFileError(f"{path}: not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointFileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointFileError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def check_field_types(cls: type, data: Mapping[str, Any], source: str, prefix: str = "") -> None:
    """Each key of `data` that names a scalar field of dataclass `cls` (int, float, bool, str) holds
    that type (an int is a float; a bool is not an int; a float is finite), else one line naming
    the source, the key, the expected type and what was found."""
    for field in dataclasses.fields(cls):
        kind = _SCALARS.get(field.type if isinstance(field.type, str) else getattr(field.type, "__name__", ""))
        if kind is None or field.name not in data:
            continue
        value = data[field.name]
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            expected = "a finite float" if kind is float else kind.__name__
            raise CheckpointFileError(
                f"{source}: key '{prefix}{field.name}': expected {expected}, found {type(value).__name__} {value!r}"
            )


def read_safetensors(path: str | Path, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one safetensors file; a file that is not one (garbage, cut short) is one
    line naming it."""
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            names = list(f.keys())
            for name in names:
                yield name, f.get_tensor(name)
    except SafetensorError as exc:
        raise CheckpointFileError(f"{path}: not a readable safetensors file ({exc})") from None


def check_floating(tensors: Mapping[str, torch.Tensor], source: str) -> None:
    """Weights are floating point of 16 bits or more: an integer or boolean tensor would be cast
    silently, and so would a float8 one, whose quantisation scales live in other tensors."""
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise CheckpointFileError(f"{source}: tensor {name}: expected a floating-point dtype, found {tensor.dtype}")
        if tensor.element_size() < 2:
            raise CheckpointFileError(
                f"{source}: tensor {name}: expected a floating-point dtype of 16 bits or more, found {tensor.dtype} "
                "(a quantised checkpoint: casting it would drop its scales)"
            )


def checkpoint_files(directory: Path) -> dict[str, str]:
    """Tensor name -> file from every `*.safetensors.index.json` (any name: releases name theirs
    after the weights file); {} when the directory has no index."""
    weight_map: dict[str, str] = {}
    for index in sorted(directory.glob("*.safetensors.index.json")):
        listed = read_json_object(index).get("weight_map")
        if not isinstance(listed, dict):
            raise CheckpointFileError(f"{index}: key 'weight_map': expected an object of tensor name -> file")
        weight_map.update(listed)
    if weight_map or any(directory.glob("*.safetensors")):
        return weight_map
    raise FileNotFoundError(f"{directory}: no *.safetensors file and no *.safetensors.index.json found")


def iterate_weights(directory: str | Path, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the directory, one file open at a time (the files
    an index lists, or every `*.safetensors` file without one)."""
    directory = Path(directory)
    weight_map = checkpoint_files(directory)
    files = sorted(set(weight_map.values())) if weight_map else sorted(p.name for p in directory.glob("*.safetensors"))
    for filename in files:
        path = directory / filename
        if not path.is_file():
            raise FileNotFoundError(f"{directory / INDEX_FILE}: shard {filename} does not exist")
        for name, tensor in read_safetensors(path, device):
            if weight_map and weight_map.get(name) != filename:
                raise ValueError(
                    f"{directory / INDEX_FILE}: tensor {name} is in {filename} but the index says {weight_map.get(name)}"
                )
            yield name, tensor


def write_weights(directory: str | Path, tensors: Mapping[str, torch.Tensor], *, max_shard_bytes: int | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    if max_shard_bytes is None:
        save_file(tensors, str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return directory
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return directory

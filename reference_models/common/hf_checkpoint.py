"""HF-style checkpoint directories: `config.json` + `model.safetensors` or shards with an index.

One job: move named tensors between a directory and memory, and say precisely what is wrong
when a state dict does not fit a model (every missing, unexpected and wrong-shaped tensor in one
error). The layout is the one `transformers` writes: shards `model-0000i-of-0000n.safetensors`
and `model.safetensors.index.json` = `{"metadata": {"total_size": bytes}, "weight_map": {name:
file}}`; reading accepts an index of any name and, without one, every `*.safetensors` file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointMismatchError(ValueError):
    """A state dict that does not fit the model; names every offending tensor at once."""

    def __init__(
        self,
        source: str,
        missing: list[str],
        unexpected: list[str],
        wrong_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        self.source = source
        self.missing = missing
        self.unexpected = unexpected
        self.wrong_shape = wrong_shape
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): " + ", ".join(missing))
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): " + ", ".join(unexpected))
        for name, expected, got in wrong_shape:
            parts.append(f"wrong shape: {name}: expected {list(expected)}, got {list(got)}")
        super().__init__(f"{source}: checkpoint does not match the model: " + "; ".join(parts))


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


def read_safetensors(
    path: str | Path, device: torch.device | str = "cpu", *, select: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one safetensors file (only the names `select` accepts are read); a file
    that is not one (garbage, cut short) is one line naming it."""
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            names = list(f.keys())
            for name in names:
                if select is None or select(name):
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


def check_state_dict(expected_shapes: Mapping[str, tuple[int, ...]], state_dict: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise CheckpointMismatchError listing every difference between names/shapes and `state_dict`."""
    missing = [name for name in expected_shapes if name not in state_dict]
    unexpected = [name for name in state_dict if name not in expected_shapes]
    wrong_shape = [
        (name, tuple(shape), tuple(state_dict[name].shape))
        for name, shape in expected_shapes.items()
        if name in state_dict and tuple(state_dict[name].shape) != tuple(shape)
    ]
    if missing or unexpected or wrong_shape:
        raise CheckpointMismatchError(source, missing, unexpected, wrong_shape)
    check_floating(state_dict, source)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def save_state_dict(directory: str | Path, state_dict: Mapping[str, torch.Tensor], *, max_shard_bytes: int | None = None) -> Path:
    """Write `state_dict` as `model.safetensors`, or as shards of at most `max_shard_bytes` plus an index.

    A tensor larger than `max_shard_bytes` gets a shard of its own. Returns the directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()}
    if max_shard_bytes is None:
        save_file(tensors, str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return directory
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = _tensor_bytes(t)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes

    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": sum(_tensor_bytes(t) for t in tensors.values())}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return directory


def weight_files(directory: str | Path) -> tuple[dict[str, str], list[str], str]:
    """(weight map, files, what was read) of a directory.

    Any `*.safetensors.index.json` counts as an index (releases name theirs after the weights
    file, e.g. `diffusion_pytorch_model.safetensors.index.json`); several indexes are merged and a
    tensor two of them list is an error. Without an index, every `*.safetensors` file is read.
    """
    directory = Path(directory)
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if indexes:
        weight_map: dict[str, str] = {}
        for index in indexes:
            listed = read_json_object(index).get("weight_map")
            if not isinstance(listed, dict):
                raise CheckpointFileError(f"{index}: key 'weight_map': expected an object of tensor name -> file")
            for name, filename in listed.items():
                if name in weight_map and weight_map[name] != filename:
                    raise ValueError(f"{directory}: tensor {name} is listed by two indexes ({weight_map[name]}, {filename})")
                weight_map[name] = filename
        return weight_map, sorted(set(weight_map.values())), ", ".join(i.name for i in indexes)
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors file and no *.safetensors.index.json found")
    return {}, files, ", ".join(files)


def tensor_names(directory: str | Path) -> list[str]:
    """Every tensor name of a directory, without reading a tensor."""
    directory = Path(directory)
    weight_map, files, _ = weight_files(directory)
    if weight_map:
        return list(weight_map)
    names: list[str] = []
    for filename in files:
        try:
            with safe_open(str(directory / filename), framework="pt") as f:
                names += list(f.keys())
        except SafetensorError as exc:
            raise CheckpointFileError(f"{directory / filename}: not a readable safetensors file ({exc})") from None
    return names


def load_state_dict(
    directory: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    *,
    select: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Read the tensors of an HF-style directory (single file or sharded, `weight_files`), cast to
    `dtype` if given; with `select`, only the names it accepts (the others are never read)."""
    directory = Path(directory)
    weight_map, files, source = weight_files(directory)
    state_dict: dict[str, torch.Tensor] = {}
    listed_elsewhere = []
    for filename in files:
        path = directory / filename
        if not path.is_file():
            raise FileNotFoundError(f"{directory / source}: shard {filename} listed in the weight map does not exist")
        for name, t in read_safetensors(path, device, select=select):
            if weight_map and weight_map.get(name) != filename:
                listed_elsewhere.append(f"{name} (in {filename}, index says {weight_map.get(name)})")
                continue
            if name in state_dict:
                raise ValueError(f"{directory}: tensor {name} is in two files ({filename} and an earlier one)")
            state_dict[name] = t if dtype is None else t.to(dtype)
    unlisted = [name for name in weight_map if name not in state_dict and (select is None or select(name))]
    if listed_elsewhere or unlisted:
        raise ValueError(
            f"{directory / source}: index and shards disagree; tensors in a shard the index does not assign them to: "
            f"{listed_elsewhere}; tensors the index lists but no shard holds: {unlisted}"
        )
    return state_dict

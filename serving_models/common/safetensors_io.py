"""The serving engine's checkpoint reader/writer: HF-style safetensors directories.

Single file (`model.safetensors`) or shards listed in `model.safetensors.index.json`. A serving
engine owns its loader, so this does not import the reference's; the file layout is the one
`transformers` writes. `WeightMismatchError` names every missing, unexpected and wrong-shaped
checkpoint tensor in one error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
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
        lines = [f"{source}: checkpoint does not match the serving model"]
        if missing:
            lines.append(f"  missing {len(missing)} tensor(s): " + ", ".join(missing))
        if unexpected:
            lines.append(f"  unexpected {len(unexpected)} tensor(s): " + ", ".join(unexpected))
        lines += [f"  wrong shape: {n}: expected {list(e)}, got {list(g)}" for n, e, g in wrong_shape]
        super().__init__("\n".join(lines))


def checkpoint_files(directory: Path) -> dict[str, str]:
    """Tensor name -> file from every `*.safetensors.index.json` (any name: releases name theirs
    after the weights file); {} when the directory has no index."""
    weight_map: dict[str, str] = {}
    for index in sorted(directory.glob("*.safetensors.index.json")):
        weight_map.update(json.loads(index.read_text())["weight_map"])
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
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if weight_map and weight_map.get(name) != filename:
                    raise ValueError(
                        f"{directory / INDEX_FILE}: tensor {name} is in {filename} but the index says {weight_map.get(name)}"
                    )
                yield name, f.get_tensor(name)


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

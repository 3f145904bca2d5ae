"""Random checkpoints with upstream tensor names, for parity runs without released weights.

`make_checkpoint(kind, size, seed, out_dir)` writes an HF-style directory through the maker
registered for `kind` in `MAKERS` ("ar" here, "dit" from `dit_checkpoint`; other model families add their
own entry), or with `layout="release"` the released composite's layout through `RELEASE_WRITERS`
(`write_release_checkpoint`; each family's `release.py` says how its part is named). The kinds are
the family keys of `parity.target.FAMILIES` (tests/repo/test_layering.py checks both registries). `random_state_dict(config, seed, device, dtype)` is the in-memory path for full-size
GPU configurations that should never touch disk.

Init (docs/model.md §9): seeded normal(0, 0.02) for matrices, embeddings and biases, and
`1 + normal(0, 0.1)` for norm weights. Upstream's zero biases and unit norm weights would make a
dropped, swapped or misapplied bias or norm weight invisible to every numeric suite; drawn values
make each tensor matter while the outputs stay well conditioned (the norm weights stay within
about 0.6..1.4). Every tensor draws from its own generator seeded by (seed, tensor name), so a
tensor's values do not depend on which other tensors exist or their order, and fp32 / bf16 / fp64
copies of one seed are roundings of the same fp32 draw.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from reference_models.ar import release as ar_release
from reference_models.ar.config import MammothModa2ARConfig, ar_config
from reference_models.ar.model import MammothModa2ForCausalLM, Qwen2RMSNorm
from reference_models.common import hf_checkpoint
from reference_models.common.release_layout import CONFIG_FILE, RELEASE_MODEL_TYPE
from reference_models.dit import checkpoint as dit_checkpoint
from reference_models.dit import config as dit_config
from reference_models.dit import release as dit_release
from reference_models.dit.checkpoint import make_dit_checkpoint

INIT_STD = 0.02  # matrices, embeddings and biases
NORM_SPREAD = 0.1  # norm weights: 1 + normal(0, NORM_SPREAD)

Maker = Callable[..., Path]
MAKERS: dict[str, Maker] = {}


def tensor_seed(seed: int, name: str) -> int:
    """A per-tensor seed: stable across runs, processes and Python versions (crc32, not hash())."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_tensor(
    name: str, shape: tuple[int, ...], kind: str, seed: int, device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    """One tensor under the init rule of docs/model.md §9; `kind` is "normal" (matrices, embeddings,
    biases: normal(0, INIT_STD)) or "norm" (norm weights: 1 + normal(0, NORM_SPREAD))."""
    if kind not in ("normal", "norm"):
        raise ValueError(f"{name}: unknown init kind {kind!r} (normal, norm)")
    generator = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    draw = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    if kind == "norm":
        return draw.mul_(NORM_SPREAD).add_(1.0).to(dtype)
    return draw.mul_(INIT_STD).to(dtype)


def init_kinds(model: nn.Module, norm_types: tuple[type[nn.Module], ...]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, init kind) for every parameter of `model` (which may live on the meta device)."""
    kinds: dict[str, tuple[tuple[int, ...], str]] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            kind = "norm" if isinstance(module, norm_types) else "normal"
            kinds[name] = (tuple(param.shape), kind)
    return kinds


class SeededARWeights:
    """The tensors of `random_state_dict(config, seed, device, dtype)`, drawn on request by name.

    Each tensor draws from its own generator seeded by (seed, name), so drawing a few names (one
    decoder layer of a streamed model, docs/lanes.md §4) gives exactly the tensors the whole state
    dict holds under those names; `random_state_dict` is this object called with every name."""

    def __init__(self, config: MammothModa2ARConfig, seed: int, device: torch.device | str, dtype: torch.dtype) -> None:
        with torch.device("meta"):
            skeleton = MammothModa2ForCausalLM(config)
        self.kinds = init_kinds(skeleton, (Qwen2RMSNorm,))
        self.seed, self.device, self.dtype = seed, device, dtype

    def __call__(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        names = list(names)
        unknown = [name for name in names if name not in self.kinds]
        if unknown:
            raise KeyError(f"not a tensor of this AR configuration: {unknown[:5]}")
        return {name: init_tensor(name, *self.kinds[name], self.seed, self.device, self.dtype) for name in names}


def random_state_dict(
    config: MammothModa2ARConfig,
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """A seeded random AR state dict with upstream names, built directly on `device` in `dtype`.

    Reproducible bit for bit for one (seed, device type); CPU and CUDA generators differ.
    """
    draws = SeededARWeights(config, seed, device, dtype)
    return draws(draws.kinds)


def make_ar_checkpoint(
    size: str,
    seed: int,
    out_dir: str | Path,
    *,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the named AR configuration with random weights to `out_dir` (config.json + safetensors)."""
    config = ar_config(size)
    out_dir = Path(out_dir)
    state_dict = random_state_dict(config, seed, "cpu", dtype)
    hf_checkpoint.save_state_dict(out_dir, state_dict, max_shard_bytes=max_shard_bytes)
    config.save(out_dir)
    return out_dir


MAKERS["ar"] = make_ar_checkpoint
MAKERS["dit"] = make_dit_checkpoint


# ---------------------------------------------------------------------------------------------
# The release layout (make-checkpoint --layout release): per family key, (size, seed) -> (its
# config.json sections, its tensors under release names)
# ---------------------------------------------------------------------------------------------

ReleaseWriter = Callable[[str, int], tuple[dict[str, Any], dict[str, torch.Tensor]]]


def _write_ar_release(size: str, seed: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = ar_config(size)
    state = random_state_dict(config, seed, "cpu", torch.float32)
    return ar_release.ar_release_config(config), ar_release.release_state_dict(state)


def _write_dit_release(size: str, seed: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = dit_config.config_for_size(size)
    state = dit_checkpoint.random_state_dict(config, seed)
    keys = dit_release.release_config_dict(config)
    for name in ("model_type", "architectures"):
        keys.pop(name, None)
    return keys, dit_release.release_state_dict(config, state, seed)


RELEASE_WRITERS: dict[str, ReleaseWriter] = {"ar": _write_ar_release, "dit": _write_dit_release}


def write_release_checkpoint(
    families: tuple[str, ...], size: str, seed: int, out_dir: str | Path, *, max_shard_bytes: int | None = None
) -> Path:
    """A directory in the release layout holding `families` (each registered in `RELEASE_WRITERS`)."""
    unknown = [f for f in families if f not in RELEASE_WRITERS]
    if unknown:
        raise ValueError(f"no release layout registered for {unknown}; registered: {sorted(RELEASE_WRITERS)}")
    config: dict[str, Any] = {"model_type": RELEASE_MODEL_TYPE, "architectures": ["Mammothmoda2Model"]}
    tensors: dict[str, torch.Tensor] = {}
    for name in families:
        keys, family_tensors = RELEASE_WRITERS[name](size, seed)
        for key, value in keys.items():  # a section two families write (llm_config): the first one's stays
            config.setdefault(key, value)
        tensors.update(family_tensors)
    out_dir = Path(out_dir)
    hf_checkpoint.save_state_dict(out_dir, tensors, max_shard_bytes=max_shard_bytes)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


WEIGHT_FILE_PATTERNS = ("*.safetensors", "*.safetensors.index.json")


def weight_files_in(directory: str | Path) -> list[str]:
    """The names of the weight files (`*.safetensors`, `*.safetensors.index.json`) directly in `directory`."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted({p.name for pattern in WEIGHT_FILE_PATTERNS for p in directory.glob(pattern) if p.is_file()})


def make_checkpoint(kind: str, size: str, seed: int, out_dir: str | Path, *, layout: str = "parity", **options) -> Path:
    """Write a random checkpoint of model family `kind` ("ar" or "dit") and `size` to `out_dir`.

    `layout` "parity": parity's own directory (flat config.json, upstream names); "release": the
    released model's layout (`write_release_checkpoint`: nested config.json, prefixed names) with
    the same weights. `options` go to the maker (e.g. `max_shard_bytes` for a sharded directory).

    The checkpoint is written next to `out_dir` first and then moved in, replacing the weight
    files of an earlier checkpoint there: an old shard or index left beside new files would be read
    by the loaders (an index wins over `model.safetensors`, docs/checkpoints.md §1), so remaking a
    directory with another shard size must leave exactly the new files.
    """
    if layout not in ("parity", "release"):
        raise ValueError(f"unknown checkpoint layout {layout!r}; expected parity or release")
    if layout == "parity" and kind not in MAKERS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; registered makers: {sorted(MAKERS)}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.writing-", dir=out_dir.parent))
    try:
        if layout == "release":
            write_release_checkpoint((kind,), size, seed, staging, **options)
        else:
            MAKERS[kind](size, seed, staging, **options)
        out_dir.mkdir(parents=True, exist_ok=True)
        written = {p.name for p in staging.iterdir()}
        for stale in weight_files_in(out_dir):
            if stale not in written:
                (out_dir / stale).unlink()
        for path in sorted(staging.iterdir()):
            os.replace(path, out_dir / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir

"""Load an HF-style DiT checkpoint directory into the serving modules.

Reads `config.json` and `model.safetensors` (or the shards of `model.safetensors.index.json`),
checks every tensor name and shape against the modules, and reports every missing, unexpected
and wrong-shaped tensor in one error before anything is assigned.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from serving_models.common.safetensors_io import check_floating, checkpoint_files, read_safetensors

from .config import DiTConfig
from .decoder import LatentDecoder
from .model import Transformer2DModel

DECODER_PREFIX = "vae_decoder."


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not fit the serving modules (names every offender)."""


def read_checkpoint(checkpoint_dir: str | Path) -> tuple[DiTConfig, dict[str, torch.Tensor]]:
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"DiT checkpoint directory not found: {root}")
    config = DiTConfig.from_file(root / "config.json")
    if (root / "model.safetensors").is_file():
        return config, dict(read_safetensors(root / "model.safetensors"))
    index = root / "model.safetensors.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{root}: neither model.safetensors nor {index.name} is present")
    weight_map: dict[str, str] = checkpoint_files(root)
    tensors: dict[str, torch.Tensor] = {}
    for file_name in sorted(set(weight_map.values())):
        shard = dict(read_safetensors(root / file_name))
        tensors.update({k: v for k, v in shard.items() if weight_map.get(k) == file_name})
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
        raise CheckpointMismatchError(f"{index}: listed but absent from their shards: {absent}")
    return config, tensors


def build_modules(
    config: DiTConfig, tensors: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype, source: str
) -> tuple[Transformer2DModel, LatentDecoder]:
    """Construct on the meta device, check names and shapes, then assign the tensors."""
    with torch.device("meta"):
        model, decoder = Transformer2DModel(config), LatentDecoder(config.decoder)
    expected = {n: p.shape for n, p in model.named_parameters()}
    expected.update({DECODER_PREFIX + n: p.shape for n, p in decoder.named_parameters()})
    missing = [n for n in expected if n not in tensors]
    unexpected = sorted(n for n in tensors if n not in expected)
    wrong = [
        f"{n}: expected {tuple(expected[n])}, got {tuple(tensors[n].shape)}"
        for n in expected
        if n in tensors and tuple(tensors[n].shape) != tuple(expected[n])
    ]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            parts.append(f"unexpected ({len(unexpected)}): " + ", ".join(unexpected))
        if wrong:
            parts.append(f"wrong shape ({len(wrong)}): " + "; ".join(wrong))
        raise CheckpointMismatchError(f"DiT checkpoint {source} does not fit the serving Transformer2DModel: " + "; ".join(parts))
    check_floating(tensors, f"DiT checkpoint {source}")
    model.load_state_dict(
        {k: v.to(device, dtype) for k, v in tensors.items() if not k.startswith(DECODER_PREFIX)},
        strict=True,
        assign=True,
    )
    decoder.load_state_dict(
        {k[len(DECODER_PREFIX) :]: v.to(device, dtype) for k, v in tensors.items() if k.startswith(DECODER_PREFIX)},
        strict=True,
        assign=True,
    )
    for module in (model, decoder):
        module.eval().requires_grad_(False)
    return model, decoder

"""Load an HF-style DiT checkpoint directory into the serving modules.

Reads `config.json` and `model.safetensors` (or the shards of `model.safetensors.index.json`),
in parity's layout or the released composite model's (`gen_dit_config` in `config.json`, the DiT
under `gen_transformer.`), checks every tensor name and shape against the modules, and reports
every missing, unexpected and wrong-shaped tensor in one error before anything is assigned.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from serving_models.common.safetensors_io import (
    check_field_types,
    check_floating,
    checkpoint_files,
    iterate_weights,
    read_json_object,
)

from .config import DecoderConfig, DiTConfig
from .decoder import LatentDecoder
from .model import Transformer2DModel
from .vae import VAE_PREFIX, build_vae_decoder

DECODER_PREFIX = "vae_decoder."


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not fit the serving modules (names every offender)."""


def read_checkpoint(checkpoint_dir: str | Path) -> tuple[DiTConfig, dict[str, torch.Tensor]]:
    """The config and tensors of a parity-layout or release-layout directory (docs/model.md §10),
    the tensors under this port's names (a release's VAE tensors under theirs, `gen_vae.*`)."""
    config, tensors, _ = read_checkpoint_and_vae(checkpoint_dir)
    return config, tensors


def read_checkpoint_and_vae(checkpoint_dir: str | Path) -> tuple[DiTConfig, dict[str, torch.Tensor], dict | None]:
    """`read_checkpoint`, and the `gen_vae_config` when the release's VAE decodes (None: parity's
    stand-in decoder, `vae_decoder.*`, decodes)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"DiT checkpoint directory not found: {root}")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"DiT checkpoint config not found: {config_path}")
    data = read_json_object(config_path)  # not UTF-8, not JSON, not an object: one line naming the file
    tensors = _read_tensors(root)
    if "gen_dit_config" not in data:
        return DiTConfig.from_json_dict(data, source=str(config_path)), tensors, None
    config = _release_config(data, str(config_path))
    own = _release_tensors(tensors)
    vae = {name: t for name, t in own.items() if name.startswith(VAE_PREFIX)}
    if any(name.startswith(DECODER_PREFIX) for name in own):  # parity's stand-in decodes; the VAE is not read
        return config, {n: t for n, t in own.items() if n not in vae}, None
    if not vae:
        raise CheckpointMismatchError(
            f"{root}: no decoder: neither the release's VAE (gen_vae.*) nor parity's stand-in decoder ({DECODER_PREFIX}*)"
        )
    return config, own, dict(data.get("gen_vae_config") or {})


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor: the files the directory's indexes list (an index wins over a `model.safetensors`
    beside it), else every `*.safetensors` file (docs/checkpoints.md §1, as the AR's loader)."""
    if not any(root.glob("*.safetensors.index.json")) and not any(root.glob("*.safetensors")):
        raise FileNotFoundError(f"{root}: neither model.safetensors nor model.safetensors.index.json is present")
    weight_map = checkpoint_files(root)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iterate_weights(root):
        if name in tensors:
            raise CheckpointMismatchError(f"{root}: tensor {name} is in two files")
        tensors[name] = tensor
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
        raise CheckpointMismatchError(f"{root}: listed by the index but absent from their shards: {absent}")
    return tensors


# The released composite model: the DiT under `gen_transformer.`; tensors of the release that this
# port's text-to-image DiT stage does not load (image-condition Q-Former, reference-image inputs,
# the VAE, the LLM); parity's stand-in decoder under `vae_decoder.`.
RELEASE_DIT = "gen_transformer."
RELEASE_SKIPPED = (
    RELEASE_DIT + "time_caption_embed.image_embedder.",
    RELEASE_DIT + "ref_image_patch_embedder.",
    RELEASE_DIT + "ref_image_refiner.",
    RELEASE_DIT + "image_index_embedding",
)
# Transformer2DModel's own defaults for keys a gen_dit_config leaves out.
RELEASE_DIT_DEFAULTS: dict[str, Any] = dict(
    patch_size=2, in_channels=16, out_channels=None, hidden_size=2304, num_layers=26, num_refiner_layers=2,
    num_attention_heads=24, num_kv_heads=8, multiple_of=256, ffn_dim_multiplier=None, norm_eps=1e-5,
    axes_dim_rope=[32, 32, 32], axes_lens=[300, 512, 512], text_feat_dim=1024, timestep_scale=1.0,
)  # fmt: skip


def _release_config(data: dict[str, Any], source: str) -> DiTConfig:
    given = {
        k: v for k, v in data["gen_dit_config"].items() if k not in ("_class_name", "_diffusers_version", "is_image_embedder")
    }
    unknown = sorted(set(given) - set(RELEASE_DIT_DEFAULTS))
    if unknown:
        raise ValueError(f"{source}: unknown gen_dit_config keys {unknown}")
    dit = {**RELEASE_DIT_DEFAULTS, **given}
    dit["out_channels"] = dit["out_channels"] or dit["in_channels"]
    check_field_types(DiTConfig, {k: v for k, v in given.items() if v is not None}, source, prefix="gen_dit_config.")
    for key in ("axes_dim_rope", "axes_lens"):
        if not (isinstance(dit[key], list) and len(dit[key]) == 3 and all(type(v) is int for v in dit[key])):
            raise ValueError(f"{source}: key 'gen_dit_config.{key}': expected a list of 3 ints, found {dit[key]!r}")
    if list(data.get("gen_axes_dim_rope") or [40, 40, 40]) != list(dit["axes_dim_rope"]):
        raise ValueError(f"{source}: gen_axes_dim_rope contradicts gen_dit_config.axes_dim_rope")
    # The RoPE tables are gen_dit_config's own (axes_lens, as the text-to-image path builds them;
    # not the composite's gen_axes_lens); the caption embedder's input width is the LLM's.
    llm = data.get("llm_config") or {}
    dit["text_feat_dim"] = (llm.get("text_config") or {}).get("hidden_size", llm.get("hidden_size", dit["text_feat_dim"]))
    if float(dit["norm_eps"]) != 1e-5:
        raise ValueError(f"{source}: norm_eps {dit['norm_eps']} != the release caption embedder's 1e-5")
    vae = data.get("gen_vae_config") or {}
    stand_in = data.get("parity_stand_in_decoder") or {}
    if not isinstance(vae, dict) or not isinstance(stand_in, dict):
        raise ValueError(f"{source}: gen_vae_config and parity_stand_in_decoder must be JSON objects")
    defaults = DecoderConfig()
    dit["vae_decoder"] = {
        "latent_channels": vae.get("latent_channels", dit["out_channels"]),
        "block_out_channels": list(stand_in.get("block_out_channels", defaults.block_out_channels)),
        "scaling_factor": vae.get("scaling_factor", defaults.scaling_factor),
        "shift_factor": 0.0 if vae.get("shift_factor", 0.0) is None else vae.get("shift_factor", defaults.shift_factor),
    }
    dit["rope_theta"] = 10000.0
    return DiTConfig.from_json_dict(dit, source=source)


def _release_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DiT stage's tensors of a release directory: the transformer's (prefix removed), parity's
    stand-in decoder's and the VAE's (names kept). Everything else is another stage's, or no
    family's at all, and is not read (docs/checkpoints.md §2)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.startswith(RELEASE_SKIPPED):
            continue
        if name.startswith(RELEASE_DIT):
            out[name[len(RELEASE_DIT) :]] = tensor
        elif name.startswith((DECODER_PREFIX, VAE_PREFIX)):
            out[name] = tensor
    return out


def build_modules(
    config: DiTConfig,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    source: str,
    vae_config: dict | None = None,
) -> tuple[Transformer2DModel, nn.Module]:
    """Construct on the meta device, check names and shapes, then assign the tensors. With
    `vae_config` the release's VAE decodes (its `gen_vae.*` tensors, checked by `vae.py`), else
    parity's stand-in decoder (`vae_decoder.*`)."""
    with torch.device("meta"):
        model = Transformer2DModel(config)
        decoder = LatentDecoder(config.decoder) if vae_config is None else None
    vae = {n: t for n, t in tensors.items() if vae_config is not None and n.startswith(VAE_PREFIX)}
    tensors = {n: t for n, t in tensors.items() if n not in vae}
    expected = {n: p.shape for n, p in model.named_parameters()}
    if decoder is not None:
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
    if decoder is None:
        return model.eval().requires_grad_(False), build_vae_decoder(vae_config, vae, device, dtype, source)
    decoder.load_state_dict(
        {k[len(DECODER_PREFIX) :]: v.to(device, dtype) for k, v in tensors.items() if k.startswith(DECODER_PREFIX)},
        strict=True,
        assign=True,
    )
    for module in (model, decoder):
        module.eval().requires_grad_(False)
    return model, decoder

"""The release's VAE as the DiT stage's decoder: diffusers' `AutoencoderKL` built from `gen_vae_config`.

A released MammothModa2 directory decodes its latents with the VAE stored under `gen_vae.` and
configured by `gen_vae_config` (docs/model.md §10). This module builds that VAE (diffusers is an
optional dependency: `pip install 'parity[vae]'`), loads its tensors and decodes as the release's
pipeline does: `latents / scaling_factor + shift_factor`, `AutoencoderKL.decode`, then diffusers'
postprocessing (`(x / 2 + 0.5).clamp(0, 1)`, times 255, rounded) to uint8 `[B, H, W, 3]`.
A parity-written directory keeps its seeded stand-in decoder (`vae_decoder.*`), which needs no
diffusers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

VAE_PREFIX = "gen_vae."
# What decoding reads: the encoder (and its quant_conv) may be absent from a directory.
DECODE_PREFIXES = ("decoder.", "post_quant_conv.")
INSTALL_HINT = "pip install 'parity[vae]' (or diffusers)"


class VAEError(ValueError):
    """The release's VAE cannot be built or loaded: one line naming the directory and what is wrong."""


def to_uint8_image(image: torch.Tensor) -> torch.Tensor:
    """`[B, 3, H, W]` in [-1, 1] -> uint8 `[B, H, W, 3]`, as diffusers' image processor rounds it (fp32+)."""
    x = image.to(torch.promote_types(image.dtype, torch.float32))
    x = (x / 2 + 0.5).clamp(0, 1) * 255
    return x.round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class ReleaseVAEDecoder(nn.Module):
    """`forward(latents [B, C, h, w]) -> uint8 [B, 8h, 8w, 3]` through the release's AutoencoderKL."""

    def __init__(self, vae: nn.Module, scaling_factor: float, shift_factor: float) -> None:
        super().__init__()
        self.vae = vae
        self.scaling_factor = scaling_factor
        self.shift_factor = shift_factor

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        dtype = next(self.vae.parameters()).dtype
        x = latents / self.scaling_factor + self.shift_factor
        return to_uint8_image(self.vae.decode(x.to(dtype), return_dict=False)[0])


def _factor(config: Mapping[str, Any], key: str, default: float, source: str) -> float:
    value = config.get(key, default)
    if value is None:
        return default  # diffusers' "no shift"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise VAEError(f"{source}: key 'gen_vae_config.{key}': expected a finite float, found {type(value).__name__} {value!r}")
    if key == "scaling_factor" and value <= 0:
        raise VAEError(
            f"{source}: key 'gen_vae_config.scaling_factor': expected a positive float (latents are divided by it), found {value!r}"
        )
    return float(value)


def build_release_vae(
    vae_config: Any,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str,
    dtype: torch.dtype,
    source: str,
) -> ReleaseVAEDecoder:
    """The decoder of a release directory: `AutoencoderKL.from_config(gen_vae_config)` with the
    `gen_vae.*` tensors (names without the prefix). Every tensor decoding reads must be there with
    its shape, and no tensor may be one the VAE does not have; one `VAEError` line otherwise."""
    if not isinstance(vae_config, Mapping):
        raise VAEError(
            f"{source}: key 'gen_vae_config': expected a JSON object describing the AutoencoderKL, found {vae_config!r}"
        )
    try:
        from diffusers import AutoencoderKL
    except ImportError:
        raise VAEError(f"{source}: decoding with the release's VAE (gen_vae.*) needs diffusers: {INSTALL_HINT}") from None
    settings = {key: value for key, value in vae_config.items() if not key.startswith("_")}
    try:
        with torch.device("meta"):
            vae = AutoencoderKL.from_config(settings)
    except (TypeError, ValueError, KeyError) as exc:
        raise VAEError(f"{source}: gen_vae_config does not build an AutoencoderKL: {type(exc).__name__}: {exc}") from None
    state = {name[len(VAE_PREFIX) :]: t for name, t in tensors.items() if name.startswith(VAE_PREFIX)}
    expected = {name: tuple(t.shape) for name, t in vae.state_dict().items()}
    missing = sorted(n for n in expected if n.startswith(DECODE_PREFIXES) and n not in state)
    unexpected = sorted(n for n in state if n not in expected)
    wrong = sorted(
        f"{n}: expected {expected[n]}, got {tuple(state[n].shape)}"
        for n in state
        if n in expected and tuple(state[n].shape) != expected[n]
    )
    if missing or unexpected or wrong:
        parts = [
            f"{what} ({len(names)}): {', '.join(VAE_PREFIX + n if what != 'wrong shape' else n for n in names[:8])}"
            for what, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
            if names
        ]
        raise VAEError(f"{source}: the gen_vae.* tensors do not fit the AutoencoderKL of gen_vae_config: {'; '.join(parts)}")
    not_floating = sorted(n for n, t in state.items() if not t.is_floating_point())
    if not_floating:
        raise VAEError(
            f"{source}: tensor {VAE_PREFIX}{not_floating[0]}: expected a floating-point dtype, found {state[not_floating[0]].dtype}"
        )
    # Decoding needs the decoder side only; an encoder the directory lacks stays empty (on meta) and unused.
    vae = vae.to_empty(device=device).to(dtype)
    vae.load_state_dict({n: t.to(device, dtype) for n, t in state.items()}, strict=False)
    vae.eval().requires_grad_(False)
    scaling = _factor(vae_config, "scaling_factor", float(vae.config.scaling_factor), source)
    shift = _factor(vae_config, "shift_factor", 0.0, source)
    return ReleaseVAEDecoder(vae, scaling, shift)

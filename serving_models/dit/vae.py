"""The serving port's reading of the release's VAE: diffusers' `AutoencoderKL` from `gen_vae_config`.

An engine decodes a released directory's latents with the VAE stored under `gen_vae.`
(docs/model.md §10) the way the release's pipeline does: `latents / scaling_factor +
shift_factor`, `AutoencoderKL.decode`, diffusers' postprocessing to uint8 `[B, H, W, 3]`. diffusers
is optional (`pip install 'parity[vae]'`); this module does not import the reference's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

VAE_PREFIX = "gen_vae."


class VAELoadError(ValueError):
    """The release's VAE cannot be built or loaded (one line)."""


def to_uint8_image(image: torch.Tensor) -> torch.Tensor:
    """`[B, 3, H, W]` in [-1, 1] -> uint8 `[B, H, W, 3]` as diffusers postprocesses it (fp32 or wider);
    a module-level function so the harness can read the VAE's float output (a stage point)."""
    image = (image.to(torch.promote_types(image.dtype, torch.float32)) / 2 + 0.5).clamp(0, 1) * 255
    return image.round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class VAEDecoder(nn.Module):
    def __init__(self, vae: nn.Module, scaling_factor: float, shift_factor: float) -> None:
        super().__init__()
        self.vae = vae
        self.scaling_factor = scaling_factor
        self.shift_factor = shift_factor

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        dtype = next(self.vae.parameters()).dtype
        return to_uint8_image(
            self.vae.decode((latents / self.scaling_factor + self.shift_factor).to(dtype), return_dict=False)[0]
        )


def build_vae_decoder(
    vae_config: Any, tensors: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype, source: str
) -> VAEDecoder:
    """`AutoencoderKL.from_config(gen_vae_config)` with the `gen_vae.*` tensors; every tensor the
    decoder side reads must be present with its shape, none may be foreign to the VAE."""
    if not isinstance(vae_config, Mapping):
        raise VAELoadError(f"{source}: gen_vae_config must be an object describing the AutoencoderKL, got {vae_config!r}")
    try:
        from diffusers import AutoencoderKL
    except ImportError:
        raise VAELoadError(f"{source}: the release's VAE (gen_vae.*) needs diffusers: pip install 'parity[vae]'") from None
    try:
        with torch.device("meta"):
            vae = AutoencoderKL.from_config({k: v for k, v in vae_config.items() if not k.startswith("_")})
    except (TypeError, ValueError, KeyError) as exc:
        raise VAELoadError(f"{source}: gen_vae_config does not build an AutoencoderKL: {exc}") from None
    state = {n.removeprefix(VAE_PREFIX): t for n, t in tensors.items() if n.startswith(VAE_PREFIX)}
    shapes = {n: tuple(t.shape) for n, t in vae.state_dict().items()}
    problems = [f"missing {VAE_PREFIX}{n}" for n in shapes if n.startswith(("decoder.", "post_quant_conv.")) and n not in state]
    problems += [f"unexpected {VAE_PREFIX}{n}" for n in state if n not in shapes]
    problems += [
        f"{VAE_PREFIX}{n}: {tuple(t.shape)} != {shapes[n]}"
        for n, t in state.items()
        if n in shapes and tuple(t.shape) != shapes[n]
    ]
    problems += [f"{VAE_PREFIX}{n}: not floating point ({t.dtype})" for n, t in state.items() if not t.is_floating_point()]
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise VAELoadError(f"{source}: the release's VAE does not load: {'; '.join(problems[:8])}{more}")
    vae = vae.to_empty(device=device).to(dtype)
    vae.load_state_dict({n: t.to(device, dtype) for n, t in state.items()}, strict=False)
    vae.eval().requires_grad_(False)

    def factor(key: str, default: float) -> float:
        value = vae_config.get(key, default)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise VAELoadError(f"{source}: gen_vae_config.{key} must be a finite number, got {value!r}")
        return float(value)

    scaling = factor("scaling_factor", float(vae.config.scaling_factor))
    if scaling <= 0:
        raise VAELoadError(f"{source}: gen_vae_config.scaling_factor must be positive, got {scaling}")
    return VAEDecoder(vae, scaling, factor("shift_factor", 0.0))

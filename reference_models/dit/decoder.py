"""A small deterministic latent decoder, so the DiT pipeline ends in a real uint8 image.

It stands in for the unconfirmed 16-channel `AutoencoderKL.decode` (docs/model.md §1): undo the VAE
scaling (`latents / scaling_factor + shift_factor`), a 3×3 conv in, one (silu, nearest ×2, 3×3
conv) stage per upsampling step, silu and a 3×3 conv to RGB, then `tanh` to [−1, 1] and uint8.
Its weights live in the DiT checkpoint under `vae_decoder.*`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DecoderConfig


def to_uint8_image(rgb: torch.Tensor) -> torch.Tensor:
    """`[B, 3, H, W]` in any float dtype → `[B, H, W, 3]` uint8 via tanh, computed in fp32+."""
    x = rgb.to(torch.promote_types(rgb.dtype, torch.float32))
    x = (torch.tanh(x) + 1.0) * 127.5
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class LatentDecoder(nn.Module):
    """`decode(latents [B, C, h, w]) -> uint8 [B, h·f, w·f, 3]`, f = 2^(stages)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        channels = config.block_out_channels
        self.conv_in = nn.Conv2d(config.latent_channels, channels[0], 3, padding=1)
        self.up_convs = nn.ModuleList([nn.Conv2d(channels[i], channels[i + 1], 3, padding=1) for i in range(len(channels) - 1)])
        self.conv_out = nn.Conv2d(channels[-1], 3, 3, padding=1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        dtype = self.conv_in.weight.dtype
        x = latents / self.config.scaling_factor + self.config.shift_factor
        x = self.conv_in(x.to(dtype))
        for conv in self.up_convs:
            x = conv(F.interpolate(F.silu(x), scale_factor=2, mode="nearest"))
        return to_uint8_image(self.conv_out(F.silu(x)))

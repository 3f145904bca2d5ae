"""The latent decoder of the DiT stage (stand-in for the unconfirmed 16-channel VAE decode).

`latents / scaling_factor + shift_factor`, conv in, one (silu, nearest ×2, conv) stage per
upsampling step, silu, conv to RGB, `tanh` to [−1, 1], uint8 `[B, H, W, 3]`. Weights come from
the checkpoint's `vae_decoder.*` tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DecoderConfig


def to_uint8_image(rgb: torch.Tensor) -> torch.Tensor:
    """`[B, 3, H, W]` RGB before `tanh` (any float dtype) -> uint8 `[B, H, W, 3]`, in fp32 or wider;
    a module-level function so the harness can read the decoder's float output (a stage point)."""
    rgb = (torch.tanh(rgb.to(torch.promote_types(rgb.dtype, torch.float32))) + 1.0) * 127.5
    return rgb.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class LatentDecoder(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        channels = config.block_out_channels
        self.conv_in = nn.Conv2d(config.latent_channels, channels[0], 3, padding=1)
        self.up_convs = nn.ModuleList([nn.Conv2d(channels[i], channels[i + 1], 3, padding=1) for i in range(len(channels) - 1)])
        self.conv_out = nn.Conv2d(channels[-1], 3, 3, padding=1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        dtype = self.conv_in.weight.dtype
        x = self.conv_in((latents / self.config.scaling_factor + self.config.shift_factor).to(dtype))
        for conv in self.up_convs:
            x = conv(F.interpolate(F.silu(x), scale_factor=2, mode="nearest"))
        return to_uint8_image(self.conv_out(F.silu(x)))

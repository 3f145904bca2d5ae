"""DiT-stage adapter of the serving port (the built-in target).

Same shape as `reference_models/dit/adapter.py` (see its docstring for the full API):
`name`, `config`, `module`, `decoder`, `device`, `dtype`; classmethods `load(checkpoint_dir,
device, dtype)` and `build(config, state_dict, device, dtype)` (module-level `load`/`build` too);
`forward(latents, timestep, text_states, text_mask) -> velocity`; `block_sites()`;
`timesteps(steps, height, width)`; `sample(text_states, text_mask, height, width, steps,
guidance_scale, cfg_range, seed, negative_states=None, negative_mask=None)` (latent height/width);
`decode(latents) -> uint8 [B,H,W,3]`; `generate(...)`; `text_condition(length, seed, batch)`;
`stage_map` and `joint_layout` (where each stage is, for localising a failing case).
`build` accepts this package's DiTConfig, a config.json dict, or any object with
`to_json_dict()` (such as the reference's config).

Sampling the serving way: CFG is two batch-1 calls per image and step, the conditional one with
the prompt's text and the unconditional one with the negative prompt's states or, without them, a
zero-length text (`[1, 0, D]`), which `_apply_refiners` keeps away from every block. The loop is
the release's (docs/model.md §8): its float32 schedule, its CFG range latch, the latents in the
model dtype between steps (Euler sum in float32), the guidance combination in the model dtype;
the timestep reaches the model in the model dtype, as upstream passes it.

Regional compile is the runner's job (the harness compiles every submodule whose class name is
in `module._repeated_blocks`); `forward` calls `self.module`, so compiled blocks are used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import DiTConfig
from .model import Transformer2DModel
from .sampler import euler_update, flow_match_timesteps, guidance_per_step, initial_noise, text_condition
from .weights import build_modules, read_checkpoint_and_vae


def _block_stages(blocks: str, *, modulated: bool) -> dict[str, object]:
    """The stages of every block of the list `blocks` (same module names in each list)."""
    at = f"{blocks}.{{layer}}"
    stages: dict[str, object] = {
        f"{at}.attn_in": {"module": f"{at}.attn", "input": True},
        **{f"{at}.{p}": f"{at}.attn.to_{p}" for p in "qkv"},
        **{f"{at}.{p}_norm": {"module": f"{at}.attn.norm_{p}", "layout": "heads"} for p in "qk"},
        **{f"{at}.{p}_rope": {"module": f"{at}.attn.rotary", "output": i, "layout": "heads"} for i, p in enumerate("qk")},
        f"{at}.attn": {"module": f"{at}.attn.to_out.0", "input": True},
        f"{at}.out_proj": f"{at}.attn.to_out.0",
        f"{at}.attn_norm": f"{at}.norm2",
        f"{at}.mlp_in": {"module": f"{at}.feed_forward", "input": True},
        f"{at}.mlp": f"{at}.feed_forward",
        f"{at}.mlp_norm": f"{at}.ffn_norm2",
        f"{at}.out": at,
    }
    if modulated:
        stages[f"{at}.adaln"] = f"{at}.norm1.linear"
    return stages


# Where each stage of parity's DiT vocabulary is (plain data: module paths under `module`,
# `function` for the sampler's and the decoder's module-level functions; parity's
# docs/localise.md §2). The joint sequence is `[text slots, image]`, the head sees the image
# tokens only (JOINT_LAYOUT).
STAGE_MAP: dict[str, object] = {
    "timesteps": {"function": "serving_models.dit.adapter:flow_match_timesteps"},
    "guidance": {"function": "serving_models.dit.adapter:guidance_per_step"},
    "time_embed": "time_caption_embed.timestep_embedder",
    "caption_embed": "time_caption_embed.caption_embedder",
    "x_embed": "x_embedder",
    "rope": {"module": "joint_rope", "output": 0},
    **_block_stages("context_refiner", modulated=False),
    **_block_stages("noise_refiner", modulated=True),
    **_block_stages("layers", modulated=True),
    "norm_out": "norm_out",
    "velocity": {"module": ""},  # the model itself
    "latents": {"function": "serving_models.dit.adapter:euler_update"},
    "decoded": [
        {"function": "serving_models.dit.decoder:to_uint8_image", "input": True},
        {"function": "serving_models.dit.vae:to_uint8_image", "input": True},
    ],
}
JOINT_LAYOUT = "text_slots"


class ServingDiT:
    """The serving DiT stage behind the adapter API."""

    name = "serving"
    stage_map = STAGE_MAP
    joint_layout = JOINT_LAYOUT

    def __init__(
        self,
        config: DiTConfig,
        module: Transformer2DModel,
        decoder: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.module = module
        self.decoder = decoder
        self.device = torch.device(device)
        self.dtype = dtype

    @classmethod
    def load(
        cls, checkpoint_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> ServingDiT:
        config, tensors, vae_config = read_checkpoint_and_vae(checkpoint_dir)
        device = torch.device(device)
        module, decoder = build_modules(config, tensors, device, dtype, source=str(checkpoint_dir), vae_config=vae_config)
        return cls(config, module, decoder, device, dtype)

    @classmethod
    def build(
        cls,
        config: Any,
        state_dict: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> ServingDiT:
        config = DiTConfig.coerce(config)
        device = torch.device(device)
        module, decoder = build_modules(config, state_dict, device, dtype, source="<in-memory state dict>")
        return cls(config, module, decoder, device, dtype)

    @torch.no_grad()
    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text_states: torch.Tensor,
        text_mask: torch.Tensor,
    ) -> torch.Tensor:
        return self.module(
            latents.to(self.device, self.dtype),
            timestep.to(self.device),
            text_states.to(self.device, self.dtype),
            text_mask.to(self.device, torch.bool),
        )

    def block_sites(self) -> list[tuple[str, nn.Module]]:
        return self.module.block_sites()

    def text_condition(self, length: int, seed: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        states, mask = text_condition(self.config.text_feat_dim, length, seed, batch)
        return states.to(self.device, self.dtype), mask.to(self.device)

    def timesteps(self, steps: int, height: int, width: int) -> torch.Tensor:
        """The schedule `sample` uses: `[steps + 1]` float32 times (CPU)."""
        return flow_match_timesteps(steps, height, width)

    @torch.no_grad()
    def sample(
        self,
        text_states: torch.Tensor,
        text_mask: torch.Tensor,
        height: int,
        width: int,
        steps: int,
        guidance_scale: float,
        cfg_range: tuple[float, float] = (0.0, 1.0),
        seed: int = 0,
        negative_states: torch.Tensor | None = None,
        negative_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch = text_states.shape[0]
        x = initial_noise((batch, self.config.in_channels, height, width), seed).to(self.device, self.dtype)
        times = flow_match_timesteps(steps, height, width).to(self.device)
        text_states = text_states.to(self.device, self.dtype)
        text_mask = text_mask.to(self.device, torch.bool)
        if negative_states is None:  # empty text: [B, 0, D]
            if negative_mask is not None:
                raise ValueError("negative_mask without negative_states")
            negative_states, negative_mask = text_states[:, :0], text_mask[:, :0]
        elif negative_mask is None:
            negative_mask = torch.ones(negative_states.shape[:2], dtype=torch.bool)
        negative_states = negative_states.to(self.device, self.dtype)
        negative_mask = negative_mask.to(self.device, torch.bool)
        for i, scale in enumerate(guidance_per_step(steps, guidance_scale, cfg_range)):
            timestep = times[i : i + 1].to(self.dtype)
            velocities = []
            for b in range(batch):  # every call is batch 1, as the serving runner issues them
                model_in = x[b : b + 1]
                v = self.module(model_in, timestep, text_states[b : b + 1], text_mask[b : b + 1])
                if scale > 1.0:
                    uncond = self.module(model_in, timestep, negative_states[b : b + 1], negative_mask[b : b + 1])
                    v = uncond + scale * (v - uncond)
                velocities.append(v)
            x = euler_update(x, torch.cat(velocities), times[i], times[i + 1])
        return x

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decoder(latents.to(self.device))

    def generate(
        self,
        text_states: torch.Tensor,
        text_mask: torch.Tensor,
        height: int,
        width: int,
        steps: int,
        guidance_scale: float,
        cfg_range: tuple[float, float] = (0.0, 1.0),
        seed: int = 0,
        negative_states: torch.Tensor | None = None,
        negative_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        latents = self.sample(
            text_states, text_mask, height, width, steps, guidance_scale, cfg_range, seed, negative_states, negative_mask
        )
        return self.decode(latents)


load = from_pretrained = ServingDiT.load
build = ServingDiT.build

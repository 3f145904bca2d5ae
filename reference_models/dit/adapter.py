"""DiT-stage adapter of the reference (the truth): what the suites call.

Adapter shape (the same in `serving_models/dit/adapter.py`; the harness codifies it):

    adapter.name: str                        "reference" | "serving"
    adapter.config                           the package's DiTConfig (same JSON fields)
    adapter.module: nn.Module                the Transformer2DModel
    adapter.decoder: nn.Module               the latent decoder
    adapter.device, adapter.dtype
    Adapter.load(checkpoint_dir, device="cpu", dtype=torch.float32) -> Adapter      (classmethod)
    Adapter.build(config, state_dict, device="cpu", dtype=torch.float32) -> Adapter (classmethod)
    adapter.forward(latents [B,C,H,W], timestep [B], text_states [B,L,D_llm], text_mask [B,L] bool)
        -> velocity [B,C,H,W] in adapter.dtype (no grad)
    adapter.block_sites() -> list[(name, TransformerBlock)] in execution order:
        context_refiner.0.., noise_refiner.0.., layers.0..
    adapter.sample(text_states [B,L,D], text_mask [B,L], height, width, steps, guidance_scale,
                   cfg_range=(0.0, 1.0), seed=0) -> latents [B,C,height,width] fp32 (fp64 for fp64)
        height/width are LATENT sizes (the image is 8x larger)
    adapter.decode(latents [B,C,h,w]) -> uint8 [B, 8h, 8w, 3]
    adapter.generate(<sample's arguments>) -> uint8 [B, 8h, 8w, 3]  (= decode(sample(...)))
    adapter.text_condition(length, seed, batch=1) -> (text_states fp32 [B,L,D], mask [B,L] bool),
        on adapter.device, in adapter.dtype (identical in both packages)

Module-level `load` (alias `from_pretrained`) and `build` are the classmethods (for
`target.load_dit` / `target.build_dit`).

Sampling here is upstream's, with one documented choice: when CFG is active the conditional and
unconditional streams run as ONE doubled batch, the unconditional rows carrying an all-false text
mask (empty text, length 0 per row), padded to the conditional text length. The reference thus
assembles a tail-padded joint sequence with a key-padding mask, which the serving port (two
batch-1 calls, the unconditional one with a zero-length text) never sees: comparing the two
exercises the serving port's mask handling and its empty-text skip. The Euler state is kept in
fp32 (fp64 for fp64 runs); the timestep is given to the model in the model dtype, as upstream.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .checkpoint import (
    DECODER_PREFIX,
    build_modules_on_meta,
    check_tensors,
    expected_shapes,
    read_checkpoint,
)
from .config import DiTConfig
from .decoder import LatentDecoder
from .model import Transformer2DModel
from .sampler import cfg_active, flow_match_timesteps, initial_noise, text_condition


class ReferenceDiT:
    """The reference DiT stage behind the adapter API (see the module docstring)."""

    name = "reference"
    # Host reads (`_cap_lens`) and no `_repeated_blocks`: not written to be compiled or captured,
    # so the suites skip their compiled and graph modes for it (parity.suites.conftest.require_graph_support).
    supports_capture = False

    def __init__(
        self,
        config: DiTConfig,
        module: Transformer2DModel,
        decoder: LatentDecoder,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.module = module
        self.decoder = decoder
        self.device = torch.device(device)
        self.dtype = dtype

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def load(
        cls, checkpoint_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> ReferenceDiT:
        config, tensors = read_checkpoint(checkpoint_dir)
        return cls._assemble(config, tensors, device, dtype, source=str(checkpoint_dir))

    @classmethod
    def build(
        cls,
        config: DiTConfig,
        state_dict: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> ReferenceDiT:
        return cls._assemble(config, state_dict, device, dtype, source="<in-memory state dict>")

    @classmethod
    def _assemble(cls, config, tensors, device, dtype, source: str) -> ReferenceDiT:
        check_tensors(expected_shapes(config), tensors, source)
        module, decoder = build_modules_on_meta(config)
        device = torch.device(device)
        model_sd = {k: v.to(device, dtype) for k, v in tensors.items() if not k.startswith(DECODER_PREFIX)}
        decoder_sd = {k[len(DECODER_PREFIX) :]: v.to(device, dtype) for k, v in tensors.items() if k.startswith(DECODER_PREFIX)}
        module.load_state_dict(model_sd, strict=True, assign=True)
        decoder.load_state_dict(decoder_sd, strict=True, assign=True)
        for m in (module, decoder):
            m.eval().requires_grad_(False)
        return cls(config, module, decoder, device, dtype)

    # -- the model -----------------------------------------------------------------------------
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

    # -- the pipeline --------------------------------------------------------------------------
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
    ) -> torch.Tensor:
        batch = text_states.shape[0]
        state_dtype = torch.promote_types(self.dtype, torch.float32)
        x = initial_noise((batch, self.config.in_channels, height, width), seed).to(self.device, state_dtype)
        times = flow_match_timesteps(steps, height, width).to(self.device)
        text_states = text_states.to(self.device, self.dtype)
        text_mask = text_mask.to(self.device, torch.bool)
        for i in range(steps):
            model_in = x.to(self.dtype)
            timestep = times[i].expand(batch).to(self.dtype)
            if cfg_active(i, steps, guidance_scale, cfg_range):
                velocity = self.module(
                    torch.cat([model_in, model_in]),
                    torch.cat([timestep, timestep]),
                    torch.cat([text_states, torch.zeros_like(text_states)]),
                    torch.cat([text_mask, torch.zeros_like(text_mask)]),
                ).to(state_dtype)
                cond, uncond = velocity.chunk(2)
                velocity = uncond + guidance_scale * (cond - uncond)
            else:
                velocity = self.module(model_in, timestep, text_states, text_mask).to(state_dtype)
            x = x + (times[i + 1] - times[i]).to(state_dtype) * velocity
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
    ) -> torch.Tensor:
        latents = self.sample(text_states, text_mask, height, width, steps, guidance_scale, cfg_range, seed)
        return self.decode(latents)


load = from_pretrained = ReferenceDiT.load
build = ReferenceDiT.build

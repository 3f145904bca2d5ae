"""DiT-stage adapter of the reference (the truth): what the suites call.

Adapter shape (the same in `serving_models/dit/adapter.py`; the harness codifies it):

    adapter.name: str                        "reference" | "serving"
    adapter.config                           the package's DiTConfig (same JSON fields)
    adapter.module: nn.Module                the Transformer2DModel
    adapter.decoder: nn.Module               the latent decoder (parity's stand-in, or the release's VAE)
    adapter.device, adapter.dtype
    Adapter.load(checkpoint_dir, device="cpu", dtype=torch.float32) -> Adapter      (classmethod)
    Adapter.build(config, state_dict, device="cpu", dtype=torch.float32) -> Adapter (classmethod)
    adapter.forward(latents [B,C,H,W], timestep [B], text_states [B,L,D_llm], text_mask [B,L] bool)
        -> velocity [B,C,H,W] in adapter.dtype (no grad)
    adapter.block_sites() -> list[(name, TransformerBlock)] in execution order:
        context_refiner.0.., noise_refiner.0.., layers.0..
    adapter.timesteps(steps, height, width) -> the N + 1 flow-match times, float32 on the CPU
    adapter.sample(text_states [B,L,D], text_mask [B,L], height, width, steps, guidance_scale,
                   cfg_range=(0.0, 1.0), seed=0, negative_states=None [B,L',D], negative_mask=None [B,L'])
        -> latents [B,C,height,width] in adapter.dtype (the state the release keeps between steps)
        height/width are LATENT sizes (the image is 8x larger); without negative states the
        unconditional branch gets empty text
    adapter.decode(latents [B,C,h,w]) -> uint8 [B, 8h, 8w, 3]
    adapter.generate(<sample's arguments>) -> uint8 [B, 8h, 8w, 3]  (= decode(sample(...)))
    adapter.text_condition(length, seed, batch=1) -> (text_states fp32 [B,L,D], mask [B,L] bool),
        on adapter.device, in adapter.dtype (identical in both packages)
    adapter.stage_map: dict                  where each stage of parity's DiT stage vocabulary is, in
        plain data (module paths under `module`, `{"function": "package.module:function"}`);
        a stage it leaves out is reported not observable when a failing case is localised
    adapter.joint_layout: str                how the main stack's joint sequence is laid out:
        "packed" ([text[:cap_len], image], padded at the tail: upstream's) or "text_slots"
        ([text slots, image]; the final layer sees the image tokens only)

Module-level `load` (alias `from_pretrained`) and `build` are the classmethods (for
`target.load_dit` / `target.build_dit`).

Sampling here is the release's (docs/model.md §8): its float32 schedule bit for bit, its CFG
range latch (the scale drops to 1.0 at the first step outside the range and stays there), the
latents kept in the model dtype between steps with the Euler sum in float32, the guidance
combination in the model dtype, and the negative prompt's states (or empty text) for the
unconditional branch. One documented choice: when CFG is active the conditional and
unconditional streams run as ONE doubled batch, both padded at the tail to the longer text (the
empty text is all padding). The reference thus assembles a tail-padded joint sequence with a
key-padding mask, which the serving port (two batch-1 calls, the unconditional one with its own
text length, 0 for empty text) never sees: comparing the two exercises the serving port's mask
handling and its empty-text skip. The timestep is given to the model in the model dtype, as the
release does; the seeded fp32 noise is rounded to the model dtype (the release draws it there).
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
    read_checkpoint_report,
)
from .config import DiTConfig
from .model import Transformer2DModel
from .sampler import euler_step, flow_match_timesteps, guidance_scales, initial_noise, text_condition
from .vae import VAE_PREFIX, build_release_vae


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
# `function` for the sampler's and the decoder's module-level functions, docs/localise.md §2).
# The joint sequence is upstream's: `[text[:cap_len], image]`, padded at the tail (JOINT_LAYOUT).
STAGE_MAP: dict[str, object] = {
    "timesteps": {"function": "reference_models.dit.adapter:flow_match_timesteps"},
    "guidance": {"function": "reference_models.dit.adapter:guidance_scales"},
    "time_embed": "time_caption_embed.timestep_embedder",
    "caption_embed": "time_caption_embed.caption_embedder",
    "x_embed": "x_embedder",
    "rope": {"module": "rope_embedder", "output": 0},
    **_block_stages("context_refiner", modulated=False),
    **_block_stages("noise_refiner", modulated=True),
    **_block_stages("layers", modulated=True),
    "norm_out": "norm_out",
    "velocity": {"module": ""},  # the model itself
    "latents": {"function": "reference_models.dit.adapter:euler_step"},
    "decoded": [
        {"function": "reference_models.dit.decoder:to_uint8_image", "input": True},
        {"function": "reference_models.dit.vae:to_uint8_image", "input": True},
    ],
}
JOINT_LAYOUT = "packed"


class ReferenceDiT:
    """The reference DiT stage behind the adapter API (see the module docstring)."""

    name = "reference"
    # Host reads (`_cap_lens`) and no `_repeated_blocks`: not written to be compiled or captured,
    # so the suites skip their compiled and graph modes for it (parity.suites.conftest.require_graph_support).
    supports_capture = False
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

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def load(
        cls, checkpoint_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> ReferenceDiT:
        config, tensors, report = read_checkpoint_report(checkpoint_dir)
        if report.decoder == "release-vae":  # a released directory: its AutoencoderKL decodes (vae.py)
            vae = {name: t for name, t in tensors.items() if name.startswith(VAE_PREFIX)}
            transformer = {name: t for name, t in tensors.items() if not name.startswith(VAE_PREFIX)}
            check_tensors(expected_shapes(config, decoder=False), transformer, str(checkpoint_dir))
            module = cls._transformer(config, transformer, torch.device(device), dtype)
            decoder = build_release_vae(report.vae_config, vae, device, dtype, str(checkpoint_dir))
            return cls(config, module, decoder, torch.device(device), dtype)
        return cls._assemble(config, tensors, device, dtype, source=str(checkpoint_dir))

    @staticmethod
    def _transformer(config: DiTConfig, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> nn.Module:
        module, _ = build_modules_on_meta(config)
        module.load_state_dict({k: v.to(device, dtype) for k, v in tensors.items()}, strict=True, assign=True)
        return module.eval().requires_grad_(False)

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
    def timesteps(self, steps: int, height: int, width: int) -> torch.Tensor:
        """The sampler's N + 1 flow-match times for a `height`×`width` latent (float32, CPU)."""
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
        negative_states, negative_mask = self._negative(text_states, negative_states, negative_mask)
        # The conditional and unconditional rows of the doubled batch, padded to one text length.
        length = max(text_states.shape[1], negative_states.shape[1])
        cfg_states = torch.cat([pad_text(text_states, length), pad_text(negative_states, length)])
        cfg_mask = torch.cat([pad_text(text_mask, length), pad_text(negative_mask, length)])
        for i, scale in enumerate(guidance_scales(steps, guidance_scale, cfg_range)):
            timestep = times[i].expand(batch).to(self.dtype)
            if scale > 1.0:
                both = self.module(torch.cat([x, x]), torch.cat([timestep, timestep]), cfg_states, cfg_mask)
                cond, uncond = both.chunk(2)
                velocity = uncond + scale * (cond - uncond)  # in the model dtype, as the release
            else:
                velocity = self.module(x, timestep, text_states, text_mask)
            x = euler_step(x, velocity, times[i], times[i + 1])
        return x

    def _negative(
        self, text_states: torch.Tensor, states: torch.Tensor | None, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The unconditional branch's text: the negative prompt's states and mask, or empty text."""
        if states is None:
            if mask is not None:
                raise ValueError("negative_mask without negative_states")
            batch, _, dim = text_states.shape
            empty = text_states.new_zeros(batch, 0, dim)
            return empty, torch.zeros(batch, 0, dtype=torch.bool, device=self.device)
        states = states.to(self.device, self.dtype)
        if states.shape[0] != text_states.shape[0] or states.shape[2] != text_states.shape[2]:
            raise ValueError(f"negative_states {tuple(states.shape)} do not match text_states {tuple(text_states.shape)}")
        if mask is None:
            mask = torch.ones(states.shape[:2], dtype=torch.bool)
        return states, mask.to(self.device, torch.bool)

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


def pad_text(t: torch.Tensor, length: int) -> torch.Tensor:
    """`t` ([B, L, ...] states or [B, L] mask) padded at the tail to `length` with zeros / False."""
    pad = t.new_zeros(t.shape[0], length - t.shape[1], *t.shape[2:])
    return torch.cat([t, pad], dim=1)


load = from_pretrained = ReferenceDiT.load
build = ReferenceDiT.build

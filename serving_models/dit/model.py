"""Serving port of the MammothModa2 DiT (`Transformer2DModel`), written to compile.

Same math as upstream (docs/model.md §6), arranged the way a serving engine needs it (docs/model.md §7):

* `_repeated_blocks = ["TransformerBlock"]`: the regional compiler compiles each block's
  `forward` with `fullgraph=True, dynamic=True`. A block body therefore has no host reads of
  tensor values (no `.item()`, `.tolist()`, `torch.any(mask)` branches), no data-dependent
  shapes and no logging; padding is handled by masks (`scaled_dot_product_attention` with a
  boolean key-padding mask, padded query rows zeroed with `where`), not by unpadding.
* The empty-text skip lives in `_apply_refiners` (vllm-project/vllm-omni#7455): the context refiner runs only
  when the text has tokens, so CFG's zero-token unconditional stream never reaches a block and
  triggers no compile. A block-level `if seq_len == 0` would guard on a backed size and compile
  a second graph when that stream first arrives.
* The whole forward is free of host reads: position ids come from `text_mask.sum()` on the
  device, the joint sequence is `[text (L slots, padding included), image]` with a mask, and the
  image tokens are always the last `h·w` positions. Upstream instead packs `[text[:cap_len],
  image]` with host-read lengths; attention is permutation-equivariant, so both give the same
  velocity up to summation order.
* No block input is a view (`block_input`): Dynamo guards a view through its base, so the noise
  refiner (fed a Linear's 3-D output, a view) and the main stack (fed a `cat`) would otherwise
  compile two graphs of the modulated kind.
* CFG runs as two batch-1 calls (the adapter's job), the unconditional one with text length 0.

Mutation points kept small and named: `_repeated_blocks`, `_apply_refiners`,
`rope_embedder.theta` (read at every call, from `config.rope_theta`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import DiTConfig

FREQUENCY_EMBEDDING_SIZE = 256
QK_NORM_EPS = 1e-5
NORM_OUT_EPS = 1e-6


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp32 runs, fp64 for fp64: where upstream computes in fp32."""
    return torch.promote_types(dtype, torch.float32)


# --------------------------------------------------------------------------------------------
# Norms and embeddings
# --------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class TimestepEmbedding(nn.Module):
    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimestepCaptionEmbedding(nn.Module):
    """temb = MLP([cos(s·t·f), sin(s·t·f)]); caption tokens = Linear(RMSNorm(LLM states))."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.timestep_scale = config.timestep_scale
        self.timestep_embedder = TimestepEmbedding(FREQUENCY_EMBEDDING_SIZE, config.temb_dim)
        self.caption_embedder = nn.Sequential(
            RMSNorm(config.text_feat_dim, eps=config.norm_eps),
            nn.Linear(config.text_feat_dim, config.hidden_size, bias=True),
        )

    def time_features(self, t: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(t.dtype)
        half = FREQUENCY_EMBEDDING_SIZE // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=dtype, device=t.device) / half)
        angles = self.timestep_scale * (t.to(dtype)[:, None] * freqs[None, :])
        return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)

    def forward(self, timestep: torch.Tensor, text_states: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        temb = self.timestep_embedder(self.time_features(timestep).to(dtype))
        return temb, self.caption_embedder(text_states)


class LuminaRMSNormZero(nn.Module):
    def __init__(self, dim: int, temb_dim: int, eps: float) -> None:
        super().__init__()
        self.linear = nn.Linear(temb_dim, 4 * dim, bias=True)
        self.norm = RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.linear(F.silu(temb)).chunk(4, dim=1)
        return self.norm(x) * (1 + scale_msa[:, None]), gate_msa, scale_mlp, gate_mlp


class LuminaLayerNormContinuous(nn.Module):
    def __init__(self, dim: int, temb_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(temb_dim, dim, bias=True)
        self.linear_2 = nn.Linear(dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale = self.linear_1(F.silu(temb).to(x.dtype))
        x = F.layer_norm(x, (x.shape[-1],), eps=NORM_OUT_EPS) * (1 + scale)[:, None, :]
        return self.linear_2(x)


# --------------------------------------------------------------------------------------------
# RoPE: computed from position ids on the device (no tables, no host reads)
# --------------------------------------------------------------------------------------------
class RotaryEmbedding3D(nn.Module):
    """cos/sin `[B, S, head_dim]` for position ids `[B, S, 3]`: axes t|h|w concatenated, each
    angle `pos·θ^(-2i/d)` computed in fp64 and repeated for its pair (2i, 2i+1)."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.theta = float(config.rope_theta)
        self.axes_dim = tuple(config.axes_dim_rope)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        device = position_ids.device
        angles = []
        for axis, dim in enumerate(self.axes_dim):
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
            angles.append(position_ids[..., axis, None].to(torch.float64) * inv_freq)
        angle = torch.cat(angles, dim=-1)
        cos = angle.cos().repeat_interleave(2, dim=-1).to(dtype)
        sin = angle.sin().repeat_interleave(2, dim=-1).to(dtype)
        return cos, sin


def text_position_ids(text_mask: torch.Tensor) -> torch.Tensor:
    """`[B, L, 3]`: real text token i → (i, i, i), a padding slot → (0, 0, 0) as upstream's packed
    positions leave padding (its rows are masked as keys and zeroed as queries, so only the bound
    matters: a padded length past the RoPE tables is fine while the real text fits)."""
    batch, text_len = text_mask.shape
    slots = torch.arange(text_len, device=text_mask.device)[None, :].expand(batch, text_len)
    return torch.where(text_mask, slots, torch.zeros_like(slots))[..., None].expand(batch, text_len, 3)


def image_position_ids(text_mask: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """`[B, h·w, 3]`: image token (r, c) → (cap_len, r, c), with cap_len = text_mask.sum()
    kept on the device (no host read)."""
    batch = text_mask.shape[0]
    device = text_mask.device
    img_len = grid_h * grid_w
    cap_len = text_mask.sum(dim=1)[:, None].expand(batch, img_len)
    rows = torch.arange(grid_h, device=device).repeat_interleave(grid_w)[None].expand(batch, img_len)
    cols = torch.arange(grid_w, device=device).repeat(grid_h)[None].expand(batch, img_len)
    return torch.stack([cap_len, rows, cols], dim=-1)


class JointRope(nn.Module):
    """cos/sin of the joint sequence, `[text slots, image]` along the tokens, as a module without
    weights: a stage point the harness taps (the RoPE table the main stack uses)."""

    def forward(
        self, text_rope: tuple[torch.Tensor, torch.Tensor], image_rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([text_rope[0], image_rope[0]], dim=1), torch.cat([text_rope[1], image_rope[1]], dim=1)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of `x [B, S, H, D]` by `cos/sin [B, S, D]` (their dtype out)."""
    x = x.to(cos.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, :, None, 0::2], sin[:, :, None, 0::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)


class Rotary(nn.Module):
    """`rotate_interleaved` on q and k, back in the model dtype, as a module without weights: a
    stage point the harness taps (q and k after RoPE); compiled, it is inlined into the block."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_interleaved(q, cos, sin).to(dtype), rotate_interleaved(k, cos, sin).to(dtype)


# --------------------------------------------------------------------------------------------
# Attention, feed-forward, block
# --------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """QK-norm, RoPE, grouped-query SDPA with a boolean key-padding mask.

    GQA without K/V copies: SDPA's `enable_gqa=True` lets query head `h` attend to K/V head
    `h // (heads // kv_heads)`, the order `repeat_interleave` gives upstream, without writing
    `heads / kv_heads` copies of K and V per block (docs/model.md §7). `materialise_kv_heads = True`
    runs the copying formulation instead: kept for the benchmark's side-by-side measurement.
    """

    materialise_kv_heads = False

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.scale = self.head_dim**-0.5
        self.to_q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.to_k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.to_v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.norm_q = RMSNorm(self.head_dim, eps=QK_NORM_EPS)
        self.norm_k = RMSNorm(self.head_dim, eps=QK_NORM_EPS)
        self.to_out = nn.ModuleList([nn.Linear(heads * self.head_dim, dim, bias=False)])
        self.rotary = Rotary()

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        dtype = x.dtype
        q = self.norm_q(self.to_q(x).unflatten(-1, (self.heads, self.head_dim)))
        k = self.norm_k(self.to_k(x).unflatten(-1, (self.kv_heads, self.head_dim)))
        v = self.to_v(x).unflatten(-1, (self.kv_heads, self.head_dim))
        q, k = self.rotary(q, k, *rope, dtype)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        grouped = self.heads != self.kv_heads
        if grouped and self.materialise_kv_heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            grouped = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=self.scale, enable_gqa=grouped)
        out = out.transpose(1, 2).flatten(2)
        # Padded query rows carry nothing downstream: keep them at zero (upstream's varlen path).
        out = torch.where(mask[:, :, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        return self.to_out[0](out)


class LuminaFeedForward(nn.Module):
    def __init__(self, dim: int, inner_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(dim, inner_dim, bias=False)
        self.linear_2 = nn.Linear(inner_dim, dim, bias=False)
        self.linear_3 = nn.Linear(dim, inner_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1, h3 = self.linear_1(x), self.linear_3(x)
        return self.linear_2(F.silu(h1.to(compute_dtype(h1.dtype))).to(h1.dtype) * h3)


class TransformerBlock(nn.Module):
    """The compiled region. `norm1` is RMSNorm (context refiner) or LuminaRMSNormZero: the two
    block kinds, so regional compile builds one graph per kind."""

    def __init__(self, config: DiTConfig, modulation: bool) -> None:
        super().__init__()
        dim = config.hidden_size
        self.modulation = modulation
        self.attn = Attention(dim, config.num_attention_heads, config.num_kv_heads)
        self.feed_forward = LuminaFeedForward(dim, config.ffn_inner_dim)
        if modulation:
            self.norm1 = LuminaRMSNormZero(dim, config.temb_dim, config.norm_eps)
        else:
            self.norm1 = RMSNorm(dim, eps=config.norm_eps)
        self.ffn_norm1 = RMSNorm(dim, eps=config.norm_eps)
        self.norm2 = RMSNorm(dim, eps=config.norm_eps)
        self.ffn_norm2 = RMSNorm(dim, eps=config.norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor],
        temb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = hidden_states
        if self.modulation:
            if temb is None:
                raise ValueError("a modulated TransformerBlock needs temb")
            normed, gate_msa, scale_mlp, gate_mlp = self.norm1(x, temb)
            x = x + gate_msa[:, None].tanh() * self.norm2(self.attn(normed, attention_mask, image_rotary_emb))
            ffn_out = self.feed_forward(self.ffn_norm1(x) * (1 + scale_mlp[:, None]))
            return x + gate_mlp[:, None].tanh() * self.ffn_norm2(ffn_out)
        x = x + self.norm2(self.attn(self.norm1(x), attention_mask, image_rotary_emb))
        return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    b, c, hp, wp = latents.shape
    x = latents.reshape(b, c, hp // p, p, wp // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (hp // p) * (wp // p), p * p * c)


def unpatchify(tokens: torch.Tensor, h: int, w: int, p: int) -> torch.Tensor:
    b = tokens.shape[0]
    x = tokens.reshape(b, h, w, p, p, -1).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, -1, h * p, w * p)


def block_input(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when it is a view: what every compiled block receives.

    Dynamo guards a view input through its base (`L['hidden_states']._base.size()[0] == ...`).
    A Linear's 3-D output is a view of its 2-D matmul result, a `torch.cat` result is not, so
    without this the noise refiner (fed by `x_embedder`) and the main stack (fed by the joint
    `cat`) compile two graphs of one block kind (measured: 3 compiles at warm-up instead of 2).
    """
    return t.clone() if t._base is not None else t


class Transformer2DModel(nn.Module):
    """`forward(latents [B,C,H,W], timestep [B], text_states [B,L,D_llm], text_mask [B,L] bool)`
    → velocity `[B,C,H,W]`. Text must be left-packed (valid tokens first), as upstream."""

    _repeated_blocks = ["TransformerBlock"]

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.config = config
        self.rope_embedder = RotaryEmbedding3D(config)
        self.joint_rope = JointRope()
        self.x_embedder = nn.Linear(config.patch_size**2 * config.in_channels, config.hidden_size, bias=True)
        self.time_caption_embed = TimestepCaptionEmbedding(config)
        self.context_refiner = nn.ModuleList(
            [TransformerBlock(config, modulation=False) for _ in range(config.num_refiner_layers)]
        )
        self.noise_refiner = nn.ModuleList([TransformerBlock(config, modulation=True) for _ in range(config.num_refiner_layers)])
        self.layers = nn.ModuleList([TransformerBlock(config, modulation=True) for _ in range(config.num_layers)])
        self.norm_out = LuminaLayerNormContinuous(config.hidden_size, config.temb_dim, config.patch_size**2 * config.out_channels)

    def block_sites(self) -> list[tuple[str, nn.Module]]:
        sites = []
        for stack in ("context_refiner", "noise_refiner", "layers"):
            sites += [(f"{stack}.{i}", block) for i, block in enumerate(getattr(self, stack))]
        return sites

    def _check_positions(self, text_mask: torch.Tensor, grid_h: int, grid_w: int) -> None:
        """RoPE positions must stay inside `axes_lens` (upstream's tables), without a host read.

        A real text token i looks up (i, i, i), padding (0, 0, 0), an image token (cap_len, r, c)
        with the real text length cap_len = text_mask.sum(). So the grid must fit axes 1 and 2 (a
        shape, refused here), and cap_len must stay below axes_lens[0] and at most axes_lens[1] and
        [2]; the padded length L bounds cap_len, so only an L past that bound depends on the mask,
        which is then asserted on the device (a RuntimeError on the CPU, a device-side assert on
        CUDA). A padded length above the tables with a real length that fits is accepted, as
        upstream and the reference accept it (docs/model.md §7)."""
        lens = self.config.axes_lens
        if grid_h > lens[1] or grid_w > lens[2]:
            raise ValueError(
                f"token grid {grid_h}x{grid_w} exceeds axes_lens {tuple(lens)} (rows and columns index axes 1 and 2)"
            )
        bound = min(lens[0] - 1, lens[1], lens[2])  # the longest real text whose positions fit
        if text_mask.shape[1] > bound:
            fits = (text_mask.sum(dim=1) <= bound).all()
            torch._assert_async(
                fits, f"a real text length of {bound + 1} tokens or more reaches the RoPE tables' end (axes_lens {tuple(lens)})"
            )

    def _apply_refiners(
        self,
        text: torch.Tensor,
        text_mask: torch.Tensor,
        text_rope: tuple[torch.Tensor, torch.Tensor],
        img: torch.Tensor,
        img_mask: torch.Tensor,
        img_rope: tuple[torch.Tensor, torch.Tensor],
        temb: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Empty-text skip: a zero-token text stream (CFG's unconditional branch) never reaches a
        # block, so it cannot specialise a compiled graph on length 0 (vllm-project/vllm-omni#7455).
        if text.shape[1] > 0:
            for layer in self.context_refiner:
                text = layer(text, text_mask, text_rope)
        for layer in self.noise_refiner:
            img = layer(img, img_mask, img_rope, temb)
        return text, img

    def _apply_transformer_layers(
        self,
        joint: torch.Tensor,
        joint_mask: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        temb: torch.Tensor,
    ) -> torch.Tensor:
        for layer in self.layers:
            joint = layer(joint, joint_mask, rope, temb)
        return joint

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text_states: torch.Tensor,
        text_mask: torch.Tensor,
    ) -> torch.Tensor:
        batch, _, height, width = latents.shape
        p = self.config.patch_size
        grid_h, grid_w = height // p, width // p
        text_len = text_states.shape[1]
        text_mask = text_mask.to(torch.bool)
        self._check_positions(text_mask, grid_h, grid_w)
        rope_dtype = compute_dtype(latents.dtype)

        temb, text = self.time_caption_embed(timestep, text_states, latents.dtype)
        img = self.x_embedder(patchify(latents, p))
        img_mask = torch.ones(batch, grid_h * grid_w, dtype=torch.bool, device=latents.device)
        text_rope = self.rope_embedder(text_position_ids(text_mask), rope_dtype)
        img_rope = self.rope_embedder(image_position_ids(text_mask, grid_h, grid_w), rope_dtype)
        joint_rope = self.joint_rope(text_rope, img_rope)
        # No block input may be a view (see block_input): Dynamo would guard on its base.
        temb, text, text_mask, img = (block_input(t) for t in (temb, text, text_mask, img))
        text_rope = tuple(block_input(t) for t in text_rope)
        img_rope = tuple(block_input(t) for t in img_rope)

        text, img = self._apply_refiners(text, text_mask, text_rope, img, img_mask, img_rope, temb)

        joint = torch.cat([text, img], dim=1)
        joint_mask = torch.cat([text_mask, img_mask], dim=1)
        joint = self._apply_transformer_layers(joint, joint_mask, joint_rope, temb)

        out = self.norm_out(joint[:, text_len:], temb)
        return unpatchify(out, grid_h, grid_w, p)

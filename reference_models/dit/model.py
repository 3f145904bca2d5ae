"""Reference MammothModa2 DiT: the Lumina2 / OmniGen2-style `Transformer2DModel` (docs/model.md §6).

Written the way upstream (`mamoda2/mammothmoda2/model/mammothmoda2_dit/`) writes it: eager
PyTorch, per-sample Python loops over host-read lengths (`mask.sum().tolist()`), the joint sequence
assembled left-packed as `[text[:cap_len], image]` and padded at the tail, RoPE gathered from
per-axis tables. It is the truth the serving port is compared with, so it is plain rather than
fast. Only text-to-image is modelled: reference images (editing) and the Q-Former image condition
are out of scope.

Read top to bottom: norms and embeddings, RoPE, attention, feed-forward, the block, the model.

Dtypes: the model runs in its parameters' dtype; where upstream computes in fp32 (RMSNorm
statistics, the SwiGLU silu, timestep features, RoPE, attention scores) this computes in
`promote_types(dtype, fp32)`, so an fp64 golden stays fp64 end to end.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import DiTConfig

FREQUENCY_EMBEDDING_SIZE = 256  # Timesteps(256, ...) in Lumina2CombinedTimestepCaptionEmbedding
QK_NORM_EPS = 1e-5  # diffusers Attention(qk_norm="rms_norm", eps=1e-5)
NORM_OUT_EPS = 1e-6  # LuminaLayerNormContinuous(eps=1e-6, elementwise_affine=False)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the steps upstream runs in fp32: fp32 for bf16/fp32 runs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


# --------------------------------------------------------------------------------------------
# Norms and embeddings
# --------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Qwen3-VL text RMSNorm: statistics in fp32, then `weight * x_normed.to(input dtype)`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def timestep_features(t: torch.Tensor, scale: float, dim: int = FREQUENCY_EMBEDDING_SIZE) -> torch.Tensor:
    """diffusers `Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0, scale)`.

    `[cos(s·t·f_i), sin(s·t·f_i)]` with `f_i = 10000^(-i/(dim/2))`, in fp32 (fp64 for fp64 t).
    """
    dtype = compute_dtype(t.dtype)
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=dtype, device=t.device) / half
    angles = scale * (t.to(dtype)[:, None] * torch.exp(exponent)[None, :])
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class TimestepEmbedding(nn.Module):
    """Linear(256 → Dt), SiLU, Linear(Dt → Dt), Dt = min(hidden, 1024)."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimestepCaptionEmbedding(nn.Module):
    """`Lumina2CombinedTimestepCaptionEmbedding`: temb from t, caption tokens from LLM states."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.timestep_scale = config.timestep_scale
        self.timestep_embedder = TimestepEmbedding(FREQUENCY_EMBEDDING_SIZE, config.temb_dim)
        self.caption_embedder = nn.Sequential(
            RMSNorm(config.text_feat_dim, eps=config.norm_eps),
            nn.Linear(config.text_feat_dim, config.hidden_size, bias=True),
        )

    def forward(self, timestep: torch.Tensor, text_states: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        temb = self.timestep_embedder(timestep_features(timestep, self.timestep_scale).to(dtype))
        return temb, self.caption_embedder(text_states)


class LuminaRMSNormZero(nn.Module):
    """adaLN for modulated blocks: `silu(temb) → Linear → scale_msa, gate_msa, scale_mlp, gate_mlp`."""

    def __init__(self, dim: int, temb_dim: int, eps: float) -> None:
        super().__init__()
        self.linear = nn.Linear(temb_dim, 4 * dim, bias=True)
        self.norm = RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.linear(F.silu(temb)).chunk(4, dim=1)
        return self.norm(x) * (1 + scale_msa[:, None]), gate_msa, scale_mlp, gate_mlp


class LuminaLayerNormContinuous(nn.Module):
    """Output head: `LayerNorm(x, no affine, eps 1e-6)·(1 + linear_1(silu temb))`, then linear_2."""

    def __init__(self, dim: int, temb_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(temb_dim, dim, bias=True)
        self.linear_2 = nn.Linear(dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale = self.linear_1(F.silu(temb).to(x.dtype))
        x = F.layer_norm(x, (x.shape[-1],), eps=NORM_OUT_EPS) * (1 + scale)[:, None, :]
        return self.linear_2(x)


# --------------------------------------------------------------------------------------------
# RoPE (rope_real.py): per-axis tables, interleaved pairs
# --------------------------------------------------------------------------------------------
def rope_axis_table(dim: int, length: int, theta: float, dtype: torch.dtype, device: torch.device):
    """cos/sin of `pos · θ^(-2i/dim)` for pos < length, built in fp64, each angle repeated for
    its pair (2i, 2i+1), then cast to `dtype` (fp32 upstream; fp64 for the golden)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float64, device=device), inv_freq)
    cos = angles.cos().repeat_interleave(2, dim=1).to(dtype)
    sin = angles.sin().repeat_interleave(2, dim=1).to(dtype)
    return cos, sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of `x [B, S, H, D]`: `o1 = x1·cos − x2·sin`, `o2 = x1·sin + x2·cos`.

    `cos`/`sin` are `[B, S, D]` with each angle repeated for its pair; the result has their dtype.
    """
    x = x.to(cos.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, :, None, 0::2], sin[:, :, None, 0::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)


class ApplyRotary(nn.Module):
    """`apply_rotary_interleaved` on q and k, cast back to the model dtype, as a module without
    weights: a stage point the harness taps (q and k after RoPE); the numbers are upstream's."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_interleaved(q, cos, sin).to(dtype), apply_rotary_interleaved(k, cos, sin).to(dtype)


class RotaryPosEmbed(nn.Module):
    """Position ids and RoPE gathered from the per-axis tables, as upstream's RotaryPosEmbedReal."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.theta = config.rope_theta
        self.axes_dim = tuple(config.axes_dim_rope)
        self.axes_lens = tuple(config.axes_lens)
        self.patch_size = config.patch_size

    def tables(self, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [rope_axis_table(d, n, self.theta, dtype, device) for d, n in zip(self.axes_dim, self.axes_lens)]

    @staticmethod
    def position_ids(cap_lens: list[int], img_hw: tuple[int, int], device: torch.device) -> torch.Tensor:
        """`[B, max_seq, 3]`: text token i → (i, i, i); image token (r, c) → (cap_len, r, c)."""
        h, w = img_hw
        seq_lens = [cap + h * w for cap in cap_lens]
        ids = torch.zeros(len(cap_lens), max(seq_lens), 3, dtype=torch.int64, device=device)
        rows = torch.arange(h, device=device).repeat_interleave(w)
        cols = torch.arange(w, device=device).repeat(h)
        for i, cap in enumerate(cap_lens):
            ids[i, :cap] = torch.arange(cap, device=device)[:, None]
            ids[i, cap : cap + h * w, 0] = cap
            ids[i, cap : cap + h * w, 1] = rows
            ids[i, cap : cap + h * w, 2] = cols
        return ids

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        for axis, (length, name) in enumerate(zip(self.axes_lens, "thw")):
            top = int(position_ids[..., axis].max()) if position_ids.numel() else 0
            if top >= length:
                raise ValueError(
                    f"RoPE position {top} on axis {name} is outside axes_lens[{axis}] = {length}: "
                    "the text is too long or the latent grid too large for this config"
                )
        cos_parts, sin_parts = [], []
        for axis, (cos, sin) in enumerate(self.tables(dtype, position_ids.device)):
            cos_parts.append(cos[position_ids[..., axis]])
            sin_parts.append(sin[position_ids[..., axis]])
        return torch.cat(cos_parts, dim=-1), torch.cat(sin_parts, dim=-1)


# --------------------------------------------------------------------------------------------
# Attention and feed-forward
# --------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Self-attention with per-head QK RMSNorm, interleaved RoPE, GQA and a key-padding mask.

    Written plainly (scores, softmax, weighted sum) in fp32 (fp64 for fp64 runs), like the flash
    kernel's fp32 accumulators. Padded query rows come back as zeros, as upstream's flash-varlen
    path returns them (`pad_input`).
    """

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
        self.rotary = ApplyRotary()

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch, seq, _ = x.shape
        dtype = x.dtype
        q = self.norm_q(self.to_q(x).view(batch, seq, self.heads, self.head_dim))
        k = self.norm_k(self.to_k(x).view(batch, seq, self.kv_heads, self.head_dim))
        v = self.to_v(x).view(batch, seq, self.kv_heads, self.head_dim)
        q, k = self.rotary(q, k, *rope, dtype)
        # GQA: KV head j serves the consecutive query heads j·rep … j·rep + rep − 1.
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)

        acc = compute_dtype(dtype)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), k.to(acc)) * self.scale
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v.to(acc))
        out = torch.where(mask[:, :, None, None], out, torch.zeros((), dtype=acc, device=x.device))
        return self.to_out[0](out.to(dtype).reshape(batch, seq, self.heads * self.head_dim))


class LuminaFeedForward(nn.Module):
    """SwiGLU `linear_2(silu(linear_1 x) * linear_3 x)`, silu in fp32, no bias."""

    def __init__(self, dim: int, inner_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(dim, inner_dim, bias=False)
        self.linear_2 = nn.Linear(inner_dim, dim, bias=False)
        self.linear_3 = nn.Linear(dim, inner_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1, h3 = self.linear_1(x), self.linear_3(x)
        return self.linear_2(F.silu(h1.to(compute_dtype(h1.dtype))).to(h1.dtype) * h3)


# --------------------------------------------------------------------------------------------
# Block and model
# --------------------------------------------------------------------------------------------
class TransformerBlock(nn.Module):
    """Sandwich-norm block; `modulation` picks LuminaRMSNormZero (adaLN, tanh gates) or RMSNorm."""

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


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """`b c (h p1) (w p2) -> b (h w) (p1 p2 c)`."""
    b, c, hp, wp = latents.shape
    x = latents.reshape(b, c, hp // p, p, wp // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (hp // p) * (wp // p), p * p * c)


def unpatchify(tokens: torch.Tensor, h: int, w: int, p: int) -> torch.Tensor:
    """`b (h w) (p1 p2 c) -> b c (h p1) (w p2)`."""
    b = tokens.shape[0]
    x = tokens.reshape(b, h, w, p, p, -1).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, -1, h * p, w * p)


class Transformer2DModel(nn.Module):
    """The DiT: embeddings, context refiner (unmodulated), noise refiner, joint stack, head.

    `forward(latents [B,C,H,W], timestep [B], text_states [B,L,D_llm], text_mask [B,L] bool)`
    returns the velocity `[B,C,H,W]`. Text must be left-packed (valid tokens first).
    """

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.rope_embedder = RotaryPosEmbed(config)
        self.x_embedder = nn.Linear(config.patch_dim, config.hidden_size, bias=True)
        self.time_caption_embed = TimestepCaptionEmbedding(config)
        self.context_refiner = nn.ModuleList(
            [TransformerBlock(config, modulation=False) for _ in range(config.num_refiner_layers)]
        )
        self.noise_refiner = nn.ModuleList([TransformerBlock(config, modulation=True) for _ in range(config.num_refiner_layers)])
        self.layers = nn.ModuleList([TransformerBlock(config, modulation=True) for _ in range(config.num_layers)])
        self.norm_out = LuminaLayerNormContinuous(config.hidden_size, config.temb_dim, config.patch_size**2 * config.out_channels)

    def block_sites(self) -> list[tuple[str, nn.Module]]:
        """Every TransformerBlock with its parameter-name prefix, in execution order."""
        sites = []
        for stack in ("context_refiner", "noise_refiner", "layers"):
            sites += [(f"{stack}.{i}", block) for i, block in enumerate(getattr(self, stack))]
        return sites

    @staticmethod
    def _cap_lens(text_mask: torch.Tensor) -> list[int]:
        """Host-read per-sample text lengths; the text must be left-packed, as upstream assumes."""
        cap_lens = [int(n) for n in text_mask.sum(dim=1).tolist()]
        for i, cap in enumerate(cap_lens):
            if not bool(text_mask[i, :cap].all()):
                raise ValueError(f"text_mask row {i} is not left-packed (valid tokens must come first)")
        return cap_lens

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text_states: torch.Tensor,
        text_mask: torch.Tensor,
    ) -> torch.Tensor:
        batch, _, height, width = latents.shape
        p = self.config.patch_size
        h, w = height // p, width // p
        dtype = latents.dtype
        device = latents.device
        text_mask = text_mask.to(torch.bool)

        # 1. Embeddings and RoPE.
        temb, text = self.time_caption_embed(timestep, text_states, dtype)
        img = self.x_embedder(patchify(latents, p))
        img_len = h * w
        cap_lens = self._cap_lens(text_mask)
        seq_lens = [cap + img_len for cap in cap_lens]
        position_ids = self.rope_embedder.position_ids(cap_lens, (h, w), device)
        cos, sin = self.rope_embedder(position_ids, compute_dtype(dtype))
        text_len = text.shape[1]
        text_cos = cos.new_zeros(batch, text_len, cos.shape[-1])
        text_sin = sin.new_zeros(batch, text_len, sin.shape[-1])
        img_cos = cos.new_zeros(batch, img_len, cos.shape[-1])
        img_sin = sin.new_zeros(batch, img_len, sin.shape[-1])
        for i, cap in enumerate(cap_lens):
            text_cos[i, :cap], text_sin[i, :cap] = cos[i, :cap], sin[i, :cap]
            img_cos[i], img_sin[i] = cos[i, cap : cap + img_len], sin[i, cap : cap + img_len]

        # 2. Refiners: text without modulation, image with it.
        for layer in self.context_refiner:
            text = layer(text, text_mask, (text_cos, text_sin))
        img_mask = torch.ones(batch, img_len, dtype=torch.bool, device=device)
        for layer in self.noise_refiner:
            img = layer(img, img_mask, (img_cos, img_sin), temb)

        # 3. Joint sequence [text[:cap_len], image], padded at the tail.
        max_seq = max(seq_lens)
        joint = img.new_zeros(batch, max_seq, self.config.hidden_size)
        joint_mask = torch.zeros(batch, max_seq, dtype=torch.bool, device=device)
        for i, (cap, seq) in enumerate(zip(cap_lens, seq_lens)):
            joint_mask[i, :seq] = True
            joint[i, :cap] = text[i, :cap]
            joint[i, cap:seq] = img[i]
        for layer in self.layers:
            joint = layer(joint, joint_mask, (cos, sin), temb)

        # 4. Head: each sample's last img_len tokens, unpatchified.
        out = self.norm_out(joint, temb)
        img_out = torch.stack([out[i, seq - img_len : seq] for i, seq in enumerate(seq_lens)])
        return unpatchify(img_out, h, w, p)

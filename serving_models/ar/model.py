"""MammothModa2 AR backbone, written the way a serving engine writes it (vllm-project/vllm-omni#9764 semantics).

Same math as upstream, shaped for graph capture and compilation:

- Fused projections: `qkv_proj` (q|k|v) and `gate_up_proj` (gate|up); `ar_weights` maps them
  to the checkpoint's tensors.
- On CUDA the decode step's small stages are fused kernels (`kernels.py`): RMSNorm with its
  weight, RoPE with the KV-cache write, SiLU with the up product; the torch ops elsewhere.
- A static KV cache updated in place (indexed writes into preallocated per-layer buffers) and attention over
  the full static length with a position mask, so a decode step has no data-dependent shapes.
- A dual embedding lookup with clamped indices on both tables, merged with `torch.where`.
- MoE dispatch that asks the target-owned capture probe: outside capture the eager fast paths
  (all-und / all-gen / mixed gather-scatter) run; under capture a `torch.where` blend runs both
  experts on every row and never reads the mask on the host; capture without a mask fails
  closed. A forward the host keys to one expert (`only_expert`: no request of the batch feeds a
  gen token, or every one does) runs that expert alone in the MoE layers, in every mode: the
  und-only and gen-only decode graphs beside the blended one.
- `requires_raw_input_tokens = True` on the AR wrappers and the top-level module, so a runner
  keeps `input_ids` beside `inputs_embeds` and the mask can be derived from the ids.

Each decision a defect could hide in is one small named function (`derive_gen_token_mask`,
`clamp_base_ids`, `clamp_gen_ids`, `moe_dispatch`, `moe_blend`, `moe_eager`,
`missing_mask_capture_error`, `make_empty_intermediate_tensors_with_gen_mask`, and
`ar_config.moe_enable`), looked up at call time so it can be replaced alone.
Read top to bottom: helpers -> norm, RoPE -> fused linear, KV cache -> attention, expert ->
routing -> decoder layer -> language model -> AR wrappers and the top-level module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from serving_models.ar import config as ar_config
from serving_models.ar import kernels
from serving_models.ar.config import QWEN2_MODEL_TYPE, QWEN3_MODEL_TYPE, MammothModa2ARConfig
from serving_models.common import capture


def upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where upstream computes in fp32, compute in this (fp64 stays fp64 for the golden)."""
    return torch.promote_types(dtype, torch.float32)


# ----------------------------------------------------------------------------------------------
# Vocabulary decisions: the gen mask and the clamped indices of both tables
# ----------------------------------------------------------------------------------------------


def derive_gen_token_mask(input_ids: torch.Tensor, gen_vocab_start_index: int) -> torch.Tensor:
    """True where the id is in the generation vocabulary; the async `-1` sentinel gives False."""
    return input_ids >= gen_vocab_start_index


def clamp_base_ids(input_ids: torch.Tensor, base_vocab_size: int) -> torch.Tensor:
    """Index into `embed_tokens` that is in range for any id (`-1` sentinel and gen ids included)."""
    return input_ids.clamp(0, base_vocab_size - 1)


def clamp_gen_ids(input_ids: torch.Tensor, gen_vocab_start_index: int, gen_vocab_size: int) -> torch.Tensor:
    """Index into `gen_embed_tokens` that is in range for any id; ids past the table take its last row."""
    return (input_ids - gen_vocab_start_index).clamp(0, gen_vocab_size - 1)


# ----------------------------------------------------------------------------------------------
# Norm and rotary position embedding
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Upstream's `weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)` with `h` upcast to fp32,
        rounded where upstream rounds; one kernel on CUDA (`kernels.rms_norm`)."""
        return kernels.rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class RotaryEmbedding(nn.Module):
    """1-D rotate-half RoPE computed from the positions tensor (no host-side table, any length)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        compute = upcast_dtype(dtype)
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=positions.device).to(compute)
        inv_freq = 1.0 / (self.theta ** (exponent / self.head_dim))
        freqs = positions[..., None].to(compute) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def negate_first_half(sin: torch.Tensor) -> torch.Tensor:
    """`sin` with the sign of rotate-half folded in (built once per forward, not once per layer)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


# Rotate-half RoPE with the sign folded into `sin_signed` (x: [B, L, heads, D]); the Qwen2 path
# fuses it with the KV-cache write (`kernels.rope_and_cache_write`).
apply_rotary = kernels.rotate_half_torch


class Rotary(nn.Module):
    """`apply_rotary` as a module without weights, so the rotated heads are a tap point (parity's
    stage map: q and k after RoPE); `x` `[B, L, heads, D]`."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin_signed)


class RotaryCacheWrite(nn.Module):
    """`kernels.rope_and_cache_write` as a module without weights (the rotated q it returns is a
    tap point; one kernel on CUDA)."""

    def forward(
        self, qkv: torch.Tensor, attn: AttentionInputs, key_cache: torch.Tensor, value_cache: torch.Tensor, heads: int
    ) -> torch.Tensor:
        return kernels.rope_and_cache_write(qkv, attn.cos, attn.sin_signed, attn.positions, key_cache, value_cache, heads)


# ----------------------------------------------------------------------------------------------
# Fused linear and the static KV cache
# ----------------------------------------------------------------------------------------------


class MergedColumnLinear(nn.Linear):
    """One GEMM for several checkpoint projections stacked along the output dim.

    `shard_names[i]` is the checkpoint module name of rows `output_sizes[i]` (e.g. q_proj, k_proj,
    v_proj); the weight loader concatenates and the saver splits along these sizes.
    """

    def __init__(self, in_features: int, output_sizes: list[int], shard_names: list[str], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = tuple(output_sizes)
        self.shard_names = tuple(shard_names)


@dataclass
class StaticKVCache:
    """Preallocated keys/values, one `[batch, kv_heads, max_len, head_dim]` tensor per layer,
    written in place. One tensor per layer rather than views of one stacked buffer: Inductor
    writes into a whole graph input in place but functionalises a write into a view of one into
    copies of the whole buffer (docs/model.md §4)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @classmethod
    def allocate(
        cls,
        config: MammothModa2ARConfig,
        batch: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_heads: int | None = None,
    ) -> StaticKVCache:
        """`kv_heads`: the heads this process holds (a tensor-parallel rank's share), default all."""
        heads = config.num_key_value_heads if kv_heads is None else kv_heads
        shape = (batch, heads, max_len, config.head_dim)
        layers = range(config.num_hidden_layers)
        zeros = lambda: tuple(torch.zeros(shape, device=device, dtype=dtype) for _ in layers)
        return cls(zeros(), zeros())

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    def clone(self) -> StaticKVCache:
        return StaticKVCache(tuple(t.clone() for t in self.keys), tuple(t.clone() for t in self.values))

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v `[B, KV, L, D]` at `positions` `[B, L]` (each < max_len); return the full buffers."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        kernels.write_cache_torch(keys, positions, k)
        kernels.write_cache_torch(values, positions, v)
        return keys, values


@dataclass
class AttentionInputs:
    """Per-forward attention metadata shared by every layer (a serving engine's forward context).

    Built once per forward (`build`), so no layer repeats it: the RoPE factors shaped to broadcast
    over heads, and over a static KV cache the additive visibility mask in the model's dtype (a
    boolean mask would be converted to one inside every layer's SDPA call).
    """

    cos: torch.Tensor  # [B, L, 1, head_dim]
    sin_signed: torch.Tensor  # [B, L, 1, head_dim]: `negate_first_half(sin)`
    positions: torch.Tensor  # [B, L]
    kv_cache: StaticKVCache | None  # None: causal attention over this call's tokens only
    cache_bias: torch.Tensor | None  # [B, 1, L, max_len]: 0 where key position <= query position, else -inf

    @classmethod
    def build(
        cls, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, kv_cache: StaticKVCache | None
    ) -> AttentionInputs:
        """cos/sin: [B, L, head_dim] in the model's dtype; positions: [B, L]."""
        bias = None
        if kv_cache is not None:
            key_positions = torch.arange(kv_cache.max_len, device=positions.device)
            visible = key_positions[None, None, None, :] <= positions[:, None, :, None]
            bias = torch.zeros(visible.shape, dtype=cos.dtype, device=cos.device).masked_fill_(~visible, float("-inf"))
        return cls(cos.unsqueeze(2), negate_first_half(sin).unsqueeze(2), positions, kv_cache, bias)


# ----------------------------------------------------------------------------------------------
# Attention and the SwiGLU expert
# ----------------------------------------------------------------------------------------------


class MammothModa2Attention(nn.Module):
    """GQA attention; Qwen2 style (q/k/v bias) or Qwen3 style (no bias, per-head q/k RMSNorm)."""

    def __init__(self, config: MammothModa2ARConfig, layer_idx: int, *, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedColumnLinear(
            config.hidden_size, [q_size, kv_size, kv_size], ["q_proj", "k_proj", "v_proj"], bias=qkv_bias
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rope = Rotary()
        self.rope_cache_write = RotaryCacheWrite()

    def forward(self, hidden_states: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        if attn.kv_cache is None:
            q, k, v = self.rotate(qkv, attn)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            q, keys, values = self.rotate_into_cache(qkv, attn)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn.cache_bias, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))

    def rotate(self, qkv: torch.Tensor, attn: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v `[B, heads, L, D]` from the fused projection, q and k rotated."""
        bsz, q_len, _ = qkv.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv[..., (heads + kv_heads) * dim :].view(bsz, q_len, kv_heads, dim)
        if self.q_norm is None:
            # q and k are adjacent columns of the fused projection: one RoPE pass rotates both
            qk = qkv[..., : (heads + kv_heads) * dim].view(bsz, q_len, heads + kv_heads, dim)
            qk = self.rope(qk, attn.cos, attn.sin_signed)
            q, k = qk[:, :, :heads], qk[:, :, heads:]
        else:
            q, k, _ = qkv.split(self.qkv_proj.output_sizes, dim=-1)
            q = self.q_norm(q.view(bsz, q_len, heads, dim))
            k = self.k_norm(k.view(bsz, q_len, kv_heads, dim))
            qk = self.rope(torch.cat((q, k), dim=2), attn.cos, attn.sin_signed)  # one tap point for both
            q, k = qk[:, :, :heads], qk[:, :, heads:]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def rotate_into_cache(self, qkv: torch.Tensor, attn: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q `[B, heads, L, D]` and this layer's whole key and value caches, the call's k
        and v written at their positions (Qwen2 attention: one kernel on CUDA)."""
        cache = attn.kv_cache
        assert cache is not None
        if self.q_norm is None:
            keys, values = cache.keys[self.layer_idx], cache.values[self.layer_idx]
            q = self.rope_cache_write(qkv, attn, keys, values, self.num_heads)
            return q.transpose(1, 2), keys, values
        q, k, v = self.rotate(qkv, attn)
        keys, values = cache.update(self.layer_idx, k, v, attn.positions)
        return q, keys, values


class SwiGLUMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up fused into one GEMM (and SiLU with the
    product into one kernel on CUDA: `kernels.silu_and_mul`)."""

    def __init__(self, config: MammothModa2ARConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [size, size], ["gate_proj", "up_proj"], bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


# ----------------------------------------------------------------------------------------------
# Routing between the understanding and generation experts
# ----------------------------------------------------------------------------------------------


def missing_mask_capture_error(layer_name: str) -> RuntimeError:
    return RuntimeError(
        f"{layer_name}: graph capture reached the MoE dispatch with gen_token_mask=None. A captured graph "
        "cannot route by token id without the mask: it would replay the understanding expert for every "
        "token, gen tokens included (vllm-project/vllm-omni#7318). Keep input_ids beside inputs_embeds "
        "(requires_raw_input_tokens) so the mask is derived, or run the AR stage without graphs: "
        "enforce_eager: true. PIECEWISE is not a workaround: its captured pieces hold the MoE MLPs and "
        "reach this dispatch as well."
    )


MASK_SHAPE_MESSAGE = "gen_token_mask: expected one torch.bool entry per row of hidden_states (shape hidden_states.shape[:-1])"


def check_gen_token_mask(hidden_states: torch.Tensor, gen_token_mask: torch.Tensor) -> None:
    """The mask has one bool entry per row of `hidden_states` (`[..., hidden]` vs `[...]`).

    Without this a short mask leaves rows of the eager path's `torch.empty` output unwritten and
    broadcasts silently in the blend. Graph-safe: only shapes and the dtype are read, never a
    device value. Outside a trace (eager, and a stream capture, which runs the Python with
    concrete shapes) a plain check raises naming both shapes; under torch.compile `torch._check`
    on the (symbolic) sizes becomes a guard or runtime assertion Dynamo keeps in the graph (its
    message may hold no tensor, hence the fixed text).
    """
    if torch.compiler.is_compiling():
        torch._check(gen_token_mask.dtype == torch.bool, lambda: MASK_SHAPE_MESSAGE)
        torch._check(gen_token_mask.dim() == hidden_states.dim() - 1, lambda: MASK_SHAPE_MESSAGE)
        for dim in range(gen_token_mask.dim()):
            torch._check(gen_token_mask.shape[dim] == hidden_states.shape[dim], lambda: MASK_SHAPE_MESSAGE)
        return
    if gen_token_mask.dtype != torch.bool or tuple(gen_token_mask.shape) != tuple(hidden_states.shape[:-1]):
        raise RuntimeError(
            f"gen_token_mask {tuple(gen_token_mask.shape)} {gen_token_mask.dtype}: expected one torch.bool entry per row "
            f"of hidden_states {tuple(hidden_states.shape)}, i.e. shape {tuple(hidden_states.shape[:-1])}"
        )


def moe_blend(
    hidden_states: torch.Tensor, und_expert: nn.Module, gen_expert: nn.Module, gen_token_mask: torch.Tensor
) -> torch.Tensor:
    """Graph-safe: both experts on every row, per-row select on the device (no host read)."""
    check_gen_token_mask(hidden_states, gen_token_mask)
    return torch.where(gen_token_mask.unsqueeze(-1), gen_expert(hidden_states), und_expert(hidden_states))


def moe_eager(
    hidden_states: torch.Tensor,
    und_expert: nn.Module,
    gen_expert: nn.Module,
    gen_token_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Eager fast paths (host reads allowed): all-und, all-gen, or gather/scatter of mixed rows.

    A missing mask routes everything to `und_expert`, as upstream does.
    """
    if gen_token_mask is not None:
        check_gen_token_mask(hidden_states, gen_token_mask)
    if gen_token_mask is None or not gen_token_mask.any():
        return und_expert(hidden_states)
    if gen_token_mask.all():
        return gen_expert(hidden_states)
    dim = hidden_states.shape[-1]
    flat = hidden_states.reshape(-1, dim)
    flat_mask = gen_token_mask.reshape(-1)
    gen_idx = flat_mask.nonzero(as_tuple=True)[0]
    und_idx = (~flat_mask).nonzero(as_tuple=True)[0]
    gen_out = gen_expert(flat.index_select(0, gen_idx))
    und_out = und_expert(flat.index_select(0, und_idx))
    out = torch.empty((flat.shape[0], und_out.shape[-1]), dtype=und_out.dtype, device=und_out.device)
    out.index_copy_(0, gen_idx, gen_out)
    out.index_copy_(0, und_idx, und_out)
    return out.view(*hidden_states.shape[:-1], -1)


def moe_dispatch(
    hidden_states: torch.Tensor,
    und_expert: nn.Module,
    gen_expert: nn.Module | None,
    gen_token_mask: torch.Tensor | None,
    layer_name: str,
) -> torch.Tensor:
    """Pick the routing strategy: eager paths outside any graph, the blend inside one, never a baked branch.

    A graph is a stream capture or a torch.compile trace: Dynamo evaluates the capture probe as
    "not capturing" while it traces, and a traced graph can no more branch on the mask's values
    than a captured one, so a compiled forward with a mask takes the blend too. Compiling without
    a mask follows eager (und everywhere, the upstream hazard); only capture fails closed.
    """
    if gen_expert is None:
        return und_expert(hidden_states)
    if torch.compiler.is_compiling():
        # Checked before the probe: Dynamo cannot trace CUDA's probe (it returns a Python bool),
        # and a compiled graph that is later captured runs no Python at all.
        if gen_token_mask is None:
            return und_expert(hidden_states)
        return moe_blend(hidden_states, und_expert, gen_expert, gen_token_mask)
    if capture.is_capturing(hidden_states.device):
        if gen_token_mask is None:
            raise missing_mask_capture_error(layer_name)
        return moe_blend(hidden_states, und_expert, gen_expert, gen_token_mask)
    return moe_eager(hidden_states, und_expert, gen_expert, gen_token_mask)


class ExpertDispatch(nn.Module):
    """`moe_dispatch` as a module without weights, so each layer's expert output is a tap point
    (parity's stage map: the und/gen blend); the experts stay the layer's `mlp` and `gen_mlp`."""

    def __init__(self, layer_name: str) -> None:
        super().__init__()
        self.layer_name = layer_name

    def forward(
        self,
        hidden_states: torch.Tensor,
        und_expert: nn.Module,
        gen_expert: nn.Module | None,
        gen_token_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        return moe_dispatch(hidden_states, und_expert, gen_expert, gen_token_mask, self.layer_name)


UND, GEN = "und", "gen"  # the expert a forward keyed to one expert runs (`only_expert`)


def poison_misrouted_tokens(hidden_states: torch.Tensor, gen_token_mask: torch.Tensor | None, only_expert: str) -> torch.Tensor:
    """NaN on every token the keyed expert must not serve (gen tokens of an und-only forward, text
    tokens of a gen-only one): graph-safe (no host read), so a broken host promise gives
    non-finite logits instead of tokens silently served by the wrong expert."""
    if gen_token_mask is None:
        return hidden_states
    wrong = gen_token_mask if only_expert == UND else ~gen_token_mask
    return hidden_states.masked_fill(wrong.unsqueeze(-1), float("nan"))


# ----------------------------------------------------------------------------------------------
# Decoder layer
# ----------------------------------------------------------------------------------------------


class MammothModa2DecoderLayer(nn.Module):
    """Pre-norm block: `h = x + attn(norm(x))`, `out = h + moe(norm(h))` (Qwen2 attention)."""

    qkv_bias = True
    qk_norm = False

    def __init__(self, config: MammothModa2ARConfig, layer_idx: int) -> None:
        super().__init__()
        if ar_config.moe_enable(config.moe_type, "attention", layer_idx):
            raise NotImplementedError(
                f"moe_type {config.moe_type!r} enables attention experts on layer {layer_idx}; "
                "this port implements FFN experts only"
            )
        self.layer_idx = layer_idx
        self.layer_name = f"model.layers.{layer_idx}"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MammothModa2Attention(config, layer_idx, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config)
        self.moe_enable = ar_config.moe_enable(config.moe_type, "ffn", layer_idx)
        self.gen_mlp = SwiGLUMLP(config) if self.moe_enable else None
        self.experts = ExpertDispatch(self.layer_name)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attn: AttentionInputs,
        gen_token_mask: torch.Tensor | None,
        only_expert: str | None = None,
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attn)
        return hidden_states + self.feed_forward(self.post_attention_layernorm(hidden_states), gen_token_mask, only_expert)

    def feed_forward(self, x: torch.Tensor, gen_token_mask: torch.Tensor | None, only_expert: str | None) -> torch.Tensor:
        """The MoE half. `only_expert` (UND or GEN): the host keyed this forward to one expert (no
        token of the batch is a gen token, or every one is): that expert alone, no blend and no
        dispatch (docs/model.md §4, mask-keyed decode graphs); a layer without a gen expert serves
        gen tokens with its `mlp`, as in the blend."""
        if only_expert == GEN and self.gen_mlp is not None:
            return self.gen_mlp(x)
        if only_expert is not None:
            return self.mlp(x)
        mask = gen_token_mask if self.moe_enable else None
        return self.experts(x, self.mlp, self.gen_mlp, mask)


class Mammoth3DecoderLayer(MammothModa2DecoderLayer):
    """Qwen3 attention: no q/k/v bias, per-head RMSNorm on q and k."""

    qkv_bias = False
    qk_norm = True


# ----------------------------------------------------------------------------------------------
# Language model (embeddings, layers, heads) and pipeline-parallel plumbing
# ----------------------------------------------------------------------------------------------


class IntermediateTensors(dict):
    """What one pipeline stage hands the next: hidden states and the gen mask (by name)."""


def make_empty_intermediate_tensors_with_gen_mask(
    batch_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str, seq_len: int = 1
) -> IntermediateTensors:
    """Static receive buffers of a later stage; seeds `gen_token_mask` so capture never sees None."""
    return IntermediateTensors(
        hidden_states=torch.zeros((batch_size, seq_len, hidden_size), dtype=dtype, device=device),
        gen_token_mask=torch.zeros((batch_size, seq_len), dtype=torch.bool, device=device),
    )


class MammothModa2Model(nn.Module):
    """Embedding tables, decoder layers and final norm (checkpoint prefix `model.`)."""

    def __init__(self, config: MammothModa2ARConfig, decoder_layer_type: type[MammothModa2DecoderLayer]) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.base_vocab_size, config.hidden_size)
        self.gen_embed_tokens = nn.Embedding(config.gen_vocab_size, config.hidden_size) if config.extra_gen_vocab else None
        self.layers = nn.ModuleList(decoder_layer_type(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)


class MammothModa2Qwen2ForCausalLM(nn.Module):
    """The MoE language model; a pipeline stage when built with a layer range `[start_layer, end_layer)`.

    Every stage holds every layer's weights (one checkpoint loads into any stage); the range
    decides which layers a stage runs and whether it embeds (first) or normalises (last).
    """

    decoder_layer_type: type[MammothModa2DecoderLayer] = MammothModa2DecoderLayer

    def __init__(self, config: MammothModa2ARConfig, *, start_layer: int = 0, end_layer: int | None = None) -> None:
        super().__init__()
        config = MammothModa2ARConfig.from_any(config)
        self.config = config
        self.start_layer = start_layer
        self.end_layer = config.num_hidden_layers if end_layer is None else end_layer
        if not 0 <= self.start_layer < self.end_layer <= config.num_hidden_layers:
            raise ValueError(f"layer range [{start_layer}, {end_layer}) is not inside [0, {config.num_hidden_layers})")
        self.model = MammothModa2Model(config, self.decoder_layer_type)
        self.lm_head = nn.Linear(config.hidden_size, config.base_vocab_size, bias=False)
        self.gen_head = nn.Linear(config.hidden_size, config.gen_vocab_size, bias=False) if config.extra_gen_vocab else None
        hidden_size = config.hidden_size

        def make_empty_intermediate_tensors(
            batch_size: int, dtype: torch.dtype, device: torch.device | str, seq_len: int = 1
        ) -> IntermediateTensors:
            # Looked up at call time (module global), so the wiring is observable and replaceable.
            return make_empty_intermediate_tensors_with_gen_mask(batch_size, hidden_size, dtype, device, seq_len)

        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors

    @property
    def is_first_stage(self) -> bool:
        return self.start_layer == 0

    @property
    def is_last_stage(self) -> bool:
        return self.end_layer == self.config.num_hidden_layers

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Both tables on every token with in-range indices, merged per token (graph-safe)."""
        cfg = self.config
        base = self.model.embed_tokens(clamp_base_ids(input_ids, cfg.base_vocab_size))
        if self.model.gen_embed_tokens is None:
            return base
        gen = self.model.gen_embed_tokens(clamp_gen_ids(input_ids, cfg.gen_vocab_start_index, cfg.gen_vocab_size))
        is_gen = derive_gen_token_mask(input_ids, cfg.gen_vocab_start_index)
        return torch.where(is_gen.unsqueeze(-1), gen, base)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        gen_token_mask: torch.Tensor | None = None,
        kv_cache: StaticKVCache | None = None,
        only_expert: str | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Hidden states `[B, L, D]` after the final norm (last stage) or the next stage's tensors.

        The mask comes from `input_ids` whenever they are given, also beside `inputs_embeds`;
        embeddings without ids and without a mask leave it None (eager: und expert everywhere,
        capture: fails closed). `only_expert=UND` is the host's promise that no token is a gen token
        (the und-only decode graph), `only_expert=GEN` that every token is one (the gen-only graph):
        every MoE layer runs that expert alone, and a token of the other kind, if one arrives
        anyway, leaves as NaN (`poison_misrouted_tokens`).
        """
        if self.is_first_stage:
            if input_ids is None and inputs_embeds is None:
                raise ValueError("the first pipeline stage needs input_ids or inputs_embeds")
            hidden_states = inputs_embeds if inputs_embeds is not None else self.get_input_embeddings(input_ids)
            if gen_token_mask is None and input_ids is not None:
                gen_token_mask = derive_gen_token_mask(input_ids, self.config.gen_vocab_start_index)
        else:
            if intermediate_tensors is None:
                raise ValueError(f"pipeline stage starting at layer {self.start_layer} needs intermediate_tensors")
            hidden_states = intermediate_tensors["hidden_states"]
            gen_token_mask = intermediate_tensors.get("gen_token_mask")

        cos, sin = self.model.rotary_emb(positions, hidden_states.dtype)
        attn = AttentionInputs.build(cos, sin, positions, kv_cache)
        for layer in self.model.layers[self.start_layer : self.end_layer]:
            hidden_states = layer(hidden_states, attn, gen_token_mask, only_expert)
        if only_expert is not None:
            hidden_states = poison_misrouted_tokens(hidden_states, gen_token_mask, only_expert)

        if not self.is_last_stage:
            tensors = IntermediateTensors(hidden_states=hidden_states)
            if gen_token_mask is not None:
                tensors["gen_token_mask"] = gen_token_mask
            return tensors
        return self.model.norm(hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[..., vocab_size + gen_vocab_size]`: base columns, then gen columns."""
        logits = self.lm_head(hidden_states)
        if self.gen_head is not None:
            logits = torch.cat([logits, self.gen_head(hidden_states)], dim=-1)
        return logits


class MammothModa2Qwen3ForCausalLM(MammothModa2Qwen2ForCausalLM):
    """Qwen3 attention layers; `forward` and `get_input_embeddings` are the Qwen2 functions themselves."""

    decoder_layer_type = Mammoth3DecoderLayer


# ----------------------------------------------------------------------------------------------
# AR wrappers and the top-level module (what the model runner sees)
# ----------------------------------------------------------------------------------------------


class MammothModa2Qwen2ARForConditionalGeneration(nn.Module):
    """AR stage on a Qwen2.5-VL backbone (the vision tower is outside this port)."""

    requires_raw_input_tokens = True  # the runner must pass input_ids beside inputs_embeds
    language_model_type: type[MammothModa2Qwen2ForCausalLM] = MammothModa2Qwen2ForCausalLM

    def __init__(self, config: MammothModa2ARConfig) -> None:
        super().__init__()
        self.config = config = MammothModa2ARConfig.from_any(config)
        self.language_model = self.language_model_type(config)
        self.make_empty_intermediate_tensors = self.language_model.make_empty_intermediate_tensors

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.get_input_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        gen_token_mask: torch.Tensor | None = None,
        kv_cache: StaticKVCache | None = None,
        only_expert: str | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.language_model(
            input_ids, positions, intermediate_tensors, inputs_embeds, gen_token_mask, kv_cache, only_expert=only_expert
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)


class MammothModa2Qwen3ARForConditionalGeneration(MammothModa2Qwen2ARForConditionalGeneration):
    """AR stage on a Qwen3-VL backbone."""

    requires_raw_input_tokens = True
    language_model_type = MammothModa2Qwen3ForCausalLM


AR_WRAPPERS: dict[str, type[MammothModa2Qwen2ARForConditionalGeneration]] = {
    QWEN2_MODEL_TYPE: MammothModa2Qwen2ARForConditionalGeneration,
    QWEN3_MODEL_TYPE: MammothModa2Qwen3ARForConditionalGeneration,
}


class MammothModa2ForConditionalGeneration(nn.Module):
    """Top-level module the runner holds; picks the AR wrapper from `config.model_type`."""

    requires_raw_input_tokens = True

    def __init__(self, config: MammothModa2ARConfig) -> None:
        super().__init__()
        self.config = config = MammothModa2ARConfig.from_any(config)
        self.ar = AR_WRAPPERS[config.model_type](config)
        self.make_empty_intermediate_tensors = self.ar.make_empty_intermediate_tensors

    @property
    def language_model(self) -> MammothModa2Qwen2ForCausalLM:
        return self.ar.language_model

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.ar.get_input_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        gen_token_mask: torch.Tensor | None = None,
        kv_cache: StaticKVCache | None = None,
        only_expert: str | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.ar(
            input_ids, positions, intermediate_tensors, inputs_embeds, gen_token_mask, kv_cache, only_expert=only_expert
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.ar.compute_logits(hidden_states)

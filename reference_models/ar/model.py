"""MammothModa2 AR backbone, written the way its authors wrote it (upstream `df2154e`, UP25 text path).

A Qwen2 decoder whose FFN is a two-expert "MoE": every layer has the understanding expert
`mlp`; the layers `moe_type` enables also have the generation expert `gen_mlp`. A token takes
`gen_mlp` iff its id is in the generation vocabulary (`id >= gen_vocab_start_index`), which also
has its own embedding table and output head. Routing reads the mask on the host (`any`, `all`,
gather and scatter of rows) exactly as upstream's `moe_forward` does, including its hazard:
`inputs_embeds` without a mask route every token to `mlp`.

Read top to bottom: RMSNorm -> RoPE -> attention -> SwiGLU expert -> moe_forward -> decoder layer
-> text model (embeddings, mask) -> causal LM (heads, outer-model entry, greedy generation).
Module and parameter names are the checkpoint names (`model.layers.N.gen_mlp.gate_proj.weight`).
Where upstream computes in fp32 (RMSNorm, RoPE tables, softmax) this computes in
`promote_types(dtype, float32)`, so an fp64 golden stays fp64.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from reference_models.ar import release as ar_release
from reference_models.ar.config import MammothModa2ARConfig
from reference_models.common import hf_checkpoint
from reference_models.common.release_layout import ReleaseLayout


def upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype upstream's "computed in fp32" means for `dtype` (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


# ----------------------------------------------------------------------------------------------
# Norm and rotary position embedding
# ----------------------------------------------------------------------------------------------


class Qwen2RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.to(upcast_dtype(input_dtype))
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _check_table_ids(indices: torch.Tensor, input_ids: torch.Tensor, table: str, first_id: int, rows: int) -> None:
    """Raise IndexError naming the token id, its position and the table when an index a lookup
    would use is outside the table (a host read: the reference is eager; skipped while compiling)."""
    if torch.compiler.is_compiling():
        return
    outside = (indices < 0) | (indices >= rows)
    if bool(outside.any()):
        position = [int(i) for i in outside.nonzero()[0]]
        token = int(input_ids[tuple(position)])
        raise IndexError(
            f"token id {token} at position {position} is outside the embedding table {table} "
            f"({rows} rows: ids {first_id}..{first_id + rows - 1})"
        )


class Qwen2RotaryEmbedding(nn.Module):
    """1-D rotate-half RoPE: text and gen tokens have equal t/h/w M-RoPE positions (docs/model.md §2)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        compute = upcast_dtype(dtype)
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=position_ids.device).to(compute)
        inv_freq = 1.0 / (self.theta ** (exponent / self.head_dim))
        freqs = position_ids[..., None].to(compute) * inv_freq  # [B, L, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class ApplyRotary(nn.Module):
    """`apply_rotary_pos_emb` as a module without weights: a stage point the harness taps (q and
    k after RoPE, docs/localise.md §2); the checkpoint and the numbers are upstream's."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_pos_emb(q, k, cos, sin)


# ----------------------------------------------------------------------------------------------
# Attention (GQA, q/k/v bias, causal) and the SwiGLU expert
# ----------------------------------------------------------------------------------------------


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, KV, L, D] -> [B, KV * n_rep, L, D], each KV head serving `n_rep` query heads."""
    b, kv, length, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, kv, n_rep, length, d).reshape(b, kv * n_rep, length, d)


class Qwen2Attention(nn.Module):
    def __init__(self, config: MammothModa2ARConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.rotary = ApplyRotary()

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        causal_mask: torch.Tensor,
    ) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q, k, *position_embeddings)

        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling + causal_mask
        probs = F.softmax(scores, dim=-1, dtype=upcast_dtype(q.dtype)).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class Qwen2MLP(nn.Module):
    """SwiGLU `down(silu(gate(x)) * up(x))`, no bias: both experts have this shape (docs/model.md §2)."""

    def __init__(self, config: MammothModa2ARConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------------------------
# Routing: upstream's moe_forward (host-side branches, gather/scatter of rows)
# ----------------------------------------------------------------------------------------------


def derive_gen_token_mask(input_ids: torch.Tensor, gen_vocab_start_index: int) -> torch.Tensor:
    """True where a token is in the generation vocabulary (docs/model.md §3)."""
    return input_ids >= gen_vocab_start_index


def moe_forward(
    hidden_states: torch.Tensor,
    und_expert: nn.Module,
    gen_expert: nn.Module | None,
    gen_token_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Route rows: mask-True rows to `gen_expert`, the rest to `und_expert` (upstream semantics).

    The mask is read on the host: None or no True -> `und_expert` on everything (the hazard);
    all True -> `gen_expert` on everything; otherwise gen rows are permuted first, each expert
    runs on its own rows, and the inverse permutation (`argsort`) restores the order.
    """
    if gen_expert is None or gen_token_mask is None or not gen_token_mask.any():
        return und_expert(hidden_states)
    if gen_token_mask.all():
        return gen_expert(hidden_states)

    bsz, q_len, dim = hidden_states.shape
    flat_hidden = hidden_states.reshape(-1, dim)
    flat_mask = gen_token_mask.reshape(-1)
    gen_pos = torch.where(flat_mask)[0]
    und_pos = torch.where(~flat_mask)[0]
    permute_order = torch.cat([gen_pos, und_pos])
    inverse_order = torch.argsort(permute_order)
    num_gen = int(flat_mask.sum())
    gen_rows, und_rows = flat_hidden[permute_order].split([num_gen, bsz * q_len - num_gen])
    merged = torch.cat([gen_expert(gen_rows), und_expert(und_rows)])[inverse_order]
    return merged.view(bsz, q_len, -1)


class MoERoute(nn.Module):
    """`moe_forward` as a module without weights: a stage point the harness taps (the und/gen
    blend, docs/localise.md §2); the experts stay the layer's own `mlp` and `gen_mlp`."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        und_expert: nn.Module,
        gen_expert: nn.Module | None,
        gen_token_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        return moe_forward(hidden_states, und_expert, gen_expert, gen_token_mask)


# ----------------------------------------------------------------------------------------------
# Decoder layer and text model
# ----------------------------------------------------------------------------------------------


class MammothModa2DecoderLayer(nn.Module):
    def __init__(self, config: MammothModa2ARConfig, layer_idx: int) -> None:
        super().__init__()
        if config.moe_enabled("attention", layer_idx):
            raise NotImplementedError(
                f"moe_type {config.moe_type!r} enables attention experts (gen_q/k/v/o_proj) on layer {layer_idx}; "
                "this port implements FFN experts only (released checkpoints ship none, docs/model.md §4)"
            )
        self.layer_idx = layer_idx
        self.self_attn = Qwen2Attention(config, layer_idx)
        self.mlp = Qwen2MLP(config)
        self.moe_enable = config.moe_enabled("ffn", layer_idx)
        self.gen_mlp = Qwen2MLP(config) if self.moe_enable else None
        self.moe = MoERoute()
        self.input_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        causal_mask: torch.Tensor,
        gen_token_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, causal_mask)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        gen_token_mask = gen_token_mask if self.moe_enable else None
        hidden_states = self.moe(hidden_states, self.mlp, self.gen_mlp, gen_token_mask)
        return residual + hidden_states


@dataclass
class TextModelOutput:
    last_hidden_state: torch.Tensor  # after the final norm
    layer_outputs: tuple[torch.Tensor, ...]  # every decoder layer's output, before the final norm


class MammothModa2TextModel(nn.Module):
    """Embeddings, decoder stack and final norm (upstream `Qwen2_5_VLTextModel`)."""

    def __init__(self, config: MammothModa2ARConfig) -> None:
        super().__init__()
        self.config = config
        self.gen_vocab_start_index = config.gen_vocab_start_index
        self.extra_gen_vocab = config.extra_gen_vocab
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.gen_embed_tokens = nn.Embedding(config.gen_vocab_size, config.hidden_size) if config.extra_gen_vocab else None
        self.layers = nn.ModuleList(MammothModa2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen2RotaryEmbedding(config.head_dim, config.rope_theta)

    def embed_input_ids(self, input_ids: torch.Tensor, gen_token_mask: torch.Tensor) -> torch.Tensor:
        """Upstream's lookup: gen positions get id 0 in `embed_tokens`, then are overwritten.

        An id outside its table raises as upstream's does (IndexError), but naming the id, its
        position and the table, not `index out of range in self`."""
        if not self.extra_gen_vocab:
            _check_table_ids(input_ids, input_ids, "embed_tokens", 0, self.embed_tokens.num_embeddings)
            return self.embed_tokens(input_ids)
        und_input_ids = input_ids.clone()
        und_input_ids[gen_token_mask] = 0
        _check_table_ids(und_input_ids, input_ids, "embed_tokens", 0, self.embed_tokens.num_embeddings)
        inputs_embeds = self.embed_tokens(und_input_ids)
        gen_ids = torch.where(gen_token_mask, input_ids - self.gen_vocab_start_index, 0)
        _check_table_ids(gen_ids, input_ids, "gen_embed_tokens", self.gen_vocab_start_index, self.gen_embed_tokens.num_embeddings)
        gen_input_ids = input_ids[gen_token_mask] - self.gen_vocab_start_index
        inputs_embeds[gen_token_mask] = self.gen_embed_tokens(gen_input_ids)
        return inputs_embeds

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        gen_token_mask: torch.Tensor | None = None,
    ) -> TextModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            # The mask is derived only here: embeddings without a mask leave it None (the hazard).
            if gen_token_mask is None:
                gen_token_mask = derive_gen_token_mask(input_ids, self.gen_vocab_start_index)
            inputs_embeds = self.embed_input_ids(input_ids, gen_token_mask)

        bsz, q_len, _ = inputs_embeds.shape
        dtype, device = inputs_embeds.dtype, inputs_embeds.device
        position_ids = torch.arange(q_len, device=device).expand(bsz, q_len)
        position_embeddings = self.rotary_emb(position_ids, dtype)
        future = torch.ones(q_len, q_len, dtype=torch.bool, device=device).triu(1)
        causal_mask = torch.zeros(q_len, q_len, dtype=dtype, device=device).masked_fill(future, torch.finfo(dtype).min)

        hidden_states = inputs_embeds
        layer_outputs = []
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, position_embeddings, causal_mask, gen_token_mask)
            layer_outputs.append(hidden_states)
        return TextModelOutput(self.norm(hidden_states), tuple(layer_outputs))


# ----------------------------------------------------------------------------------------------
# Causal LM: heads, outer-model entry, greedy generation
# ----------------------------------------------------------------------------------------------


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, L, vocab_size + gen_vocab_size], base columns then gen columns
    hidden_states: tuple[torch.Tensor, ...]  # per decoder layer, before the final norm
    last_hidden_state: torch.Tensor  # after the final norm


class MammothModa2ForCausalLM(nn.Module):
    """The AR backbone with `lm_head` and `gen_head` (untied); checkpoint names as upstream's."""

    def __init__(self, config: MammothModa2ARConfig) -> None:
        super().__init__()
        if config.model_type != "mammothmoda2_qwen2_5_vl":
            raise NotImplementedError(
                f"model_type {config.model_type!r}: the reference implements the Qwen2.5 text path (mammothmoda2_qwen2_5_vl) only"
            )
        self.config = config
        self.model = MammothModa2TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gen_head = nn.Linear(config.hidden_size, config.gen_vocab_size, bias=False) if config.extra_gen_vocab else None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if self.gen_head is not None:
            logits = torch.cat([logits, self.gen_head(hidden_states)], dim=-1)
        return logits

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        gen_token_mask: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, gen_token_mask=gen_token_mask)
        return CausalLMOutput(self.compute_logits(out.last_hidden_state), out.layer_outputs, out.last_hidden_state)

    def forward_multimodal(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> CausalLMOutput:
        """Upstream's outer VL model: the mask comes from the ids, the embeddings are passed down.

        (`Qwen2_5_VLModel.forward` derives `gen_token_mask` from `input_ids`, builds the
        embeddings, scatters image features in, then calls the text model with
        `input_ids=None, inputs_embeds, gen_token_mask`.)
        """
        gen_token_mask = derive_gen_token_mask(input_ids, self.config.gen_vocab_start_index)
        return self(inputs_embeds=inputs_embeds, gen_token_mask=gen_token_mask)

    @torch.no_grad()
    def greedy_generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy decoding by full recompute; the mask is re-derived from all ids at every step.

        Returns (tokens [B, N], step_logits [B, N, V]): `step_logits[:, i]` chose `tokens[:, i]`.
        """
        ids = input_ids
        tokens, step_logits = [], []
        for _ in range(max_new_tokens):
            logits = self(input_ids=ids).logits[:, -1]
            next_token = self.config.token_of_column(logits.argmax(dim=-1, keepdim=True))
            tokens.append(next_token)
            step_logits.append(logits)
            ids = torch.cat([ids, next_token], dim=1)
        if not tokens:
            width = self.config.logits_width
            dtype = self.lm_head.weight.dtype
            return input_ids.new_zeros(input_ids.shape[0], 0), input_ids.new_zeros(input_ids.shape[0], 0, width, dtype=dtype)
        return torch.cat(tokens, dim=1), torch.stack(step_logits, dim=1)

    # ---- HF-style checkpoints (names are the module's own parameter names) ----

    @classmethod
    def from_state_dict(
        cls,
        config: MammothModa2ARConfig,
        state_dict: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        source: str = "state dict",
    ) -> MammothModa2ForCausalLM:
        """Build on the meta device and adopt `state_dict` (cast to `device`/`dtype`): no init, no disk."""
        with torch.device("meta"):
            model = cls(config)
        expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
        hf_checkpoint.check_state_dict(expected, state_dict, source)
        tensors = {name: state_dict[name].to(device=device, dtype=dtype) for name in expected}
        model.load_state_dict(tensors, strict=True, assign=True)
        return model.eval()

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        others: Iterable[ReleaseLayout] = (),
    ) -> MammothModa2ForCausalLM:
        """From a parity or a release directory (`reference_models.ar.release.load_ar`: the nested
        config, the prefixed names; the tensors of `others`, the other families' layouts, left to
        them: the caller passes them, so the model knows no registry); `checkpoint_file_names`
        keeps how the directory spells each tensor whose name differs from the module's."""
        config, state_dict, spelt = ar_release.load_ar(directory, device=device, others=others)
        model = cls.from_state_dict(config, state_dict, device, dtype, source=str(directory))
        model.checkpoint_file_names = {k: v for k, v in spelt.items() if k != v}
        return model

    def save_pretrained(self, directory: str | Path, *, max_shard_bytes: int | None = None) -> Path:
        directory = Path(directory)
        hf_checkpoint.save_state_dict(directory, self.state_dict(), max_shard_bytes=max_shard_bytes)
        self.config.save(directory)
        return directory

"""The serving AR backbone tensor-parallel over `torch.distributed`, the way engines shard it.

Megatron-style splits, each rank holding 1/N of every large weight:

- q|k|v and gate|up are **column-parallel**: every projection of a fused weight is split by
  output rows and the rank's pieces stacked (`ColumnParallelLinear`); a rank runs `heads/N`
  query heads and `kv_heads/N` key/value heads, and its KV cache holds only those.
- o_proj and each expert's down projection are **row-parallel**: split by input columns, the
  partial products summed by an all-reduce (`RowParallelLinear`). o_proj fuses the residual add
  into its all-reduce, as the all-reduce + residual fusions of serving engines do: the residual
  is added once, after the sum (`row_parallel_output`).
- The text and gen embedding tables and both heads are **vocabulary-parallel**: a rank holds a
  contiguous block of rows of each table, each table split by its own size
  (`vocab_shard_bounds`); a lookup answers the ids inside its block and zero elsewhere, then an
  all-reduce sums the ranks (`vocab_shard_lookup`); a head computes its block of logit columns
  and an all-gather concatenates them in rank order.
- The graph-safe und/gen blend, the gen mask and the clamped lookups are the single-process
  model's own functions: a rank's experts return summed outputs, so the blend is unchanged.

The collectives are `torch.distributed._functional_collectives`: traced by `make_fx` (the CPU
graph stand-in) and by Dynamo/Inductor as ops, so every execution mode runs them, and each one
is bounded by the process group's timeout. The weight loader (`load_sharded`) reads the same
checkpoints as the single-process model (parity's layout and the release layout), checks every
tensor's full shape, and gives each rank its slices. Every decision a sharding bug could hide in
is a module-level function looked up at call time, so it can be replaced alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol

from serving_models.ar import model as ar_model
from serving_models.ar import weights as ar_weights
from serving_models.ar.config import MammothModa2ARConfig
from serving_models.ar.model import MammothModa2ForConditionalGeneration, MergedColumnLinear
from serving_models.common import safetensors_io

# `all_gather_single` replaced `all_gather_tensor` (same arguments) in recent torch releases.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group: what a sharded target's factory gets."""

    rank: int
    world_size: int
    group: Any  # a torch.distributed ProcessGroup

    @classmethod
    def of(cls, tp: Any) -> TensorParallel:
        """Any object with `rank`, `world_size` and `group` (what parity passes the factory)."""
        return tp if isinstance(tp, cls) else cls(tp.rank, tp.world_size, tp.group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(tensor, "sum", self.group)

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` concatenated along the last dim, in rank order.

        Gathered along dim 0 and concatenated here: a gather along another dim goes through
        funcol's `_maybe_view_chunk_cat`, which torch 2.11's Dynamo refuses to trace (marked as
        skipped), so the compiled modes could not run there (docs/targets.md §11)."""
        stacked = _all_gather(tensor.contiguous(), 0, self.group)
        return torch.cat(torch.chunk(stacked, self.world_size, dim=0), dim=-1)


class ShardingError(ValueError):
    """A configuration that cannot be split over the group (the message names the size)."""


# ----------------------------------------------------------------------------------------------
# Sharding decisions (each replaceable alone)
# ----------------------------------------------------------------------------------------------


def shard_size(size: int, world_size: int, what: str) -> int:
    if size % world_size:
        raise ShardingError(f"{what} = {size} is not divisible by the tensor-parallel size {world_size}")
    return size // world_size


def vocab_shard_bounds(table_rows: int, rank: int, world_size: int, what: str) -> tuple[int, int]:
    """Rows `[lo, hi)` of a table of `table_rows` rows that `rank` holds: the table's own split."""
    rows = shard_size(table_rows, world_size, what)
    return rank * rows, (rank + 1) * rows


def column_shard(parts: list[torch.Tensor], rank: int, world_size: int) -> torch.Tensor:
    """The rank's rows of a fused column-parallel weight: each projection split, the pieces stacked."""
    return torch.cat([part.chunk(world_size, dim=0)[rank] for part in parts], dim=0)


def row_parallel_output(partial: torch.Tensor, residual: torch.Tensor | None, tp: TensorParallel) -> torch.Tensor:
    """Sum the ranks' partial products; a fused residual is added once, after the sum."""
    out = tp.all_reduce(partial)
    return out if residual is None else out + residual


def expert_reduces(expert: str) -> bool:
    """Whether an expert's (`mlp`, `gen_mlp`) down projection all-reduces its output: every one does."""
    return True


def vocab_shard_lookup(indices: torch.Tensor, weight: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """This rank's part of a lookup of table rows `indices`: its own rows, zero for any other id."""
    inside = (indices >= lo) & (indices < hi)
    local = torch.where(inside, indices - lo, torch.zeros_like(indices))
    return F.embedding(local, weight) * inside.unsqueeze(-1).to(weight.dtype)


def gen_table_rows(input_ids: torch.Tensor, config: MammothModa2ARConfig) -> torch.Tensor:
    """Gen-table row of every id, clamped: counted from the gen vocabulary's own start, which need
    not be the text table's size (docs/checkpoints.md §4)."""
    return ar_model.clamp_gen_ids(input_ids, config.gen_vocab_start_index, config.gen_vocab_size)


# ----------------------------------------------------------------------------------------------
# Parallel layers
# ----------------------------------------------------------------------------------------------


class ColumnParallelLinear(MergedColumnLinear):
    """A fused projection holding this rank's rows of each part (`output_sizes` are local)."""

    def __init__(self, full: MergedColumnLinear, tp: TensorParallel) -> None:
        local = [shard_size(size, tp.world_size, f"{name} rows") for size, name in zip(full.output_sizes, full.shard_names)]
        super().__init__(full.in_features, local, list(full.shard_names), bias=full.bias is not None)
        self.tp = tp


class RowParallelLinear(nn.Linear):
    """This rank's input columns; the output summed over the ranks (`row_parallel_output`)."""

    def __init__(self, full: nn.Linear, tp: TensorParallel, *, reduce: bool = True) -> None:
        if full.bias is not None:
            raise ShardingError("a row-parallel linear with a bias is not part of this model")
        super().__init__(shard_size(full.in_features, tp.world_size, "row-parallel input columns"), full.out_features, bias=False)
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if not self.reduce:
            return partial if residual is None else partial + residual
        return row_parallel_output(partial, residual, self.tp)


class VocabParallelEmbedding(nn.Embedding):
    """Rows `[lo, hi)` of a table; `num_embeddings` stays the whole table's (the lookup indices it
    receives are the whole table's, clamped by the model)."""

    def __init__(self, full: nn.Embedding, tp: TensorParallel, bounds: tuple[int, int]) -> None:
        lo, hi = bounds
        super().__init__(hi - lo, full.embedding_dim)
        self.num_embeddings = full.num_embeddings
        self.lo, self.hi = lo, hi
        self.tp = tp

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(vocab_shard_lookup(indices, self.weight, self.lo, self.hi))

    def extra_repr(self) -> str:
        return f"rows [{self.lo}, {self.hi}) of {self.num_embeddings}, dim {self.embedding_dim}"


class VocabParallelHead(nn.Linear):
    """Logit columns `[lo, hi)` of a head; the ranks' blocks gathered in rank order."""

    def __init__(self, full: nn.Linear, tp: TensorParallel, bounds: tuple[int, int]) -> None:
        lo, hi = bounds
        super().__init__(full.in_features, hi - lo, bias=False)
        self.lo, self.hi = lo, hi
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(hidden, self.weight))


# ----------------------------------------------------------------------------------------------
# The sharded model: the single-process classes with their layers swapped
# ----------------------------------------------------------------------------------------------


def _attention_forward(self: ar_model.MammothModa2Attention, hidden_states, attn, residual=None):
    """The single-process attention with this rank's heads, the residual fused into o_proj's all-reduce."""
    bsz, q_len, _ = hidden_states.shape
    qkv = self.qkv_proj(hidden_states)
    if attn.kv_cache is None:
        q, k, v = self.rotate(qkv, attn)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        q, keys, values = self.rotate_into_cache(qkv, attn)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn.cache_bias, enable_gqa=True)
    return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1), residual)


class ShardedAttention(ar_model.MammothModa2Attention):
    forward = _attention_forward


class ShardedDecoderLayer(ar_model.MammothModa2DecoderLayer):
    """`h = o_proj(attn) + x` with the add fused into the all-reduce; the MoE half unchanged."""

    def forward(self, hidden_states, attn, gen_token_mask, only_expert: str | None = None):
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attn, hidden_states)
        return hidden_states + self.feed_forward(self.post_attention_layernorm(hidden_states), gen_token_mask, only_expert)


class ShardedQwen3DecoderLayer(ShardedDecoderLayer):
    qkv_bias = False
    qk_norm = True


class ShardedCausalLM(ar_model.MammothModa2Qwen2ForCausalLM):
    """The language model over vocabulary-parallel tables; `forward` is the single-process one."""

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The single-process blend; each table's lookup is all-reduced over the ranks."""
        cfg = self.config
        base = self.model.embed_tokens(ar_model.clamp_base_ids(input_ids, cfg.base_vocab_size))
        if self.model.gen_embed_tokens is None:
            return base
        gen = self.model.gen_embed_tokens(gen_table_rows(input_ids, cfg))
        is_gen = ar_model.derive_gen_token_mask(input_ids, cfg.gen_vocab_start_index)
        return torch.where(is_gen.unsqueeze(-1), gen, base)


def shard_module(module: MammothModa2ForConditionalGeneration, tp: TensorParallel) -> None:
    """Swap every large layer of a (meta) single-process module for its parallel form, in place."""
    lm = module.language_model
    config = lm.config
    shard_size(config.num_attention_heads, tp.world_size, "num_attention_heads")
    shard_size(config.num_key_value_heads, tp.world_size, "num_key_value_heads")
    lm.__class__ = ShardedCausalLM
    for layer in lm.model.layers:
        layer.__class__ = ShardedQwen3DecoderLayer if layer.self_attn.q_norm is not None else ShardedDecoderLayer
        attn = layer.self_attn
        attn.__class__ = ShardedAttention
        attn.num_heads //= tp.world_size
        attn.num_kv_heads //= tp.world_size
        attn.qkv_proj = ColumnParallelLinear(attn.qkv_proj, tp)
        attn.o_proj = RowParallelLinear(attn.o_proj, tp)
        for expert in ("mlp", "gen_mlp"):
            mlp = getattr(layer, expert)
            if mlp is not None:
                mlp.gate_up_proj = ColumnParallelLinear(mlp.gate_up_proj, tp)
                mlp.down_proj = RowParallelLinear(mlp.down_proj, tp, reduce=expert_reduces(expert))
    model = lm.model
    model.embed_tokens = VocabParallelEmbedding(
        model.embed_tokens, tp, vocab_shard_bounds(config.base_vocab_size, tp.rank, tp.world_size, "text table rows")
    )
    lm.lm_head = VocabParallelHead(
        lm.lm_head, tp, vocab_shard_bounds(config.base_vocab_size, tp.rank, tp.world_size, "lm_head rows")
    )
    if model.gen_embed_tokens is not None:
        gen_bounds = vocab_shard_bounds(config.gen_vocab_size, tp.rank, tp.world_size, "gen table rows")
        model.gen_embed_tokens = VocabParallelEmbedding(model.gen_embed_tokens, tp, gen_bounds)
        lm.gen_head = VocabParallelHead(lm.gen_head, tp, gen_bounds)
    module.tp = tp


def shard_of(module: nn.Module, name: str, parts: list[torch.Tensor], tp: TensorParallel) -> torch.Tensor:
    """The rank's slice of the checkpoint tensors `parts` behind parameter `name` of a sharded module."""
    owner = module.get_submodule(name.rsplit(".", 1)[0])
    if isinstance(owner, ColumnParallelLinear):
        return column_shard(parts, tp.rank, tp.world_size)
    (full,) = parts
    if isinstance(owner, RowParallelLinear):
        return full.chunk(tp.world_size, dim=1)[tp.rank]
    if isinstance(owner, (VocabParallelEmbedding, VocabParallelHead)):
        return full[owner.lo : owner.hi]
    return full


def load_sharded(
    config: MammothModa2ARConfig | Mapping | object,
    checkpoint: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    tp: TensorParallel,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    source: str = "state dict",
) -> MammothModa2ForConditionalGeneration:
    """This rank's sharded module from full checkpoint tensors (upstream names): every tensor's full
    shape is checked as the single-process loader checks it, then sliced."""
    config = MammothModa2ARConfig.from_any(config)
    with torch.device("meta"):
        module = MammothModa2ForConditionalGeneration(config)
    tensors = dict(checkpoint.items() if isinstance(checkpoint, Mapping) else checkpoint)
    ar_weights.check_checkpoint(module, tensors, source)
    shard_module(module, tp)
    params = {}
    for name, param in module.named_parameters():
        parts = [tensors[p] for p in ar_weights.checkpoint_names_for(name)]
        piece = shard_of(module, name, parts, tp).to(device=device, dtype=dtype).contiguous()
        if piece.shape != param.shape:
            raise ShardingError(
                f"{source}: {name} of rank {tp.rank} has shape {tuple(piece.shape)}, expected {tuple(param.shape)}"
            )
        params[name] = piece
    module.load_state_dict(params, strict=True, assign=True)
    return module.eval().requires_grad_(False)


def from_pretrained(
    directory: str | Path, tp: TensorParallel, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> MammothModa2ForConditionalGeneration:
    """This rank's shard of a checkpoint directory in parity's layout or the release layout."""
    config = MammothModa2ARConfig.from_pretrained(directory)
    release = "llm_config" in safetensors_io.read_json_object(Path(directory) / "config.json")
    spelt: dict[str, str] = {}
    local: dict[str, torch.Tensor] = {}
    for name, tensor in safetensors_io.iterate_weights(directory, "cpu"):
        checkpoint_name = ar_weights.local_checkpoint_name(name, release=release)
        if checkpoint_name is not None:
            spelt[checkpoint_name] = name
            local[checkpoint_name] = tensor
    module = load_sharded(config, local, tp, device, dtype, source=str(directory))
    module.checkpoint_file_names = {k: v for k, v in spelt.items() if k != v}
    return module

"""The example engine, tensor-parallel: the same model split over the ranks of a process group.

Still the *engine's* code (it imports nothing from parity or the built-in models), sharded the
way vLLM shards a Llama-style model, each parallel layer carrying its own `weight_loader`:

- `qkv_proj` and `gate_up_proj`: column-parallel, each checkpoint projection split by rows and
  the rank's piece copied to its place in the fused parameter; a rank runs `heads / N` query
  heads and `kv_heads / N` key/value heads (its KV caches hold only those);
- `o_proj` and `down_proj`: row-parallel, split by input columns, the partial products summed by
  an all-reduce;
- both embedding tables and both heads: vocabulary-parallel, each table split by its own size;
  a lookup answers its own rows (zero elsewhere) and is all-reduced, a head's logit columns are
  all-gathered in rank order.

The fused-residual layers, the blend and the clamped lookups are `engine.py`'s own code.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol

from examples.engine_target.engine import EngineConfig, MammothEngineModel, MergedLinear, _sources

_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _split(size: int, world_size: int, what: str) -> int:
    if size % world_size:
        raise ValueError(f"engine: {what} = {size} does not split over {world_size} ranks")
    return size // world_size


class ColumnParallelMerged(MergedLinear):
    def __init__(self, full: MergedLinear, group: Any) -> None:
        local = {name: _split(rows, group.world_size, name) for name, rows in full.shards.items()}
        super().__init__(full.in_features, local, bias=full.bias is not None)
        self.group = group

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None) -> None:
        if shard is None:
            raise ValueError("engine: a merged projection is loaded one named shard at a time")
        order = list(self.shards)
        rows = self.shards[shard]
        offset = sum(self.shards[key] for key in order[: order.index(shard)])
        param.data[offset : offset + rows].copy_(loaded.chunk(self.group.world_size, dim=0)[self.group.rank])


class RowParallelLinear(nn.Linear):
    def __init__(self, full: nn.Linear, group: Any) -> None:
        super().__init__(_split(full.in_features, group.world_size, "input columns"), full.out_features, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(F.linear(x, self.weight), "sum", self.group.group)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None) -> None:
        param.data.copy_(loaded.chunk(self.group.world_size, dim=1)[self.group.rank])


class VocabParallelEmbedding(nn.Embedding):
    """Rows `[lo, hi)` of the table; `num_embeddings` is the whole table's (the indices are too)."""

    def __init__(self, full: nn.Embedding, group: Any) -> None:
        rows = _split(full.num_embeddings, group.world_size, "embedding rows")
        super().__init__(rows, full.embedding_dim)
        self.num_embeddings = full.num_embeddings
        self.lo, self.hi = group.rank * rows, (group.rank + 1) * rows
        self.group = group

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        mine = (indices >= self.lo) & (indices < self.hi)
        rows = F.embedding(torch.where(mine, indices - self.lo, torch.zeros_like(indices)), self.weight)
        return funcol.all_reduce(rows * mine[..., None].to(rows.dtype), "sum", self.group.group)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None) -> None:
        param.data.copy_(loaded[self.lo : self.hi])


class VocabParallelHead(nn.Linear):
    def __init__(self, full: nn.Linear, group: Any) -> None:
        rows = _split(full.out_features, group.world_size, "head rows")
        super().__init__(full.in_features, rows, bias=False)
        self.lo = group.rank * rows
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # gathered along dim 0, then concatenated: torch 2.11's Dynamo cannot trace a gather along
        # another dim (funcol's `_maybe_view_chunk_cat`, docs/targets.md §11)
        stacked = _gather(F.linear(hidden, self.weight).contiguous(), 0, self.group.group)
        return torch.cat(torch.chunk(stacked, self.group.world_size, dim=0), dim=-1)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None) -> None:
        param.data.copy_(loaded[self.lo : self.lo + self.out_features])


class ShardedEngineModel(MammothEngineModel):
    """`MammothEngineModel` with this rank's shard of every large layer."""

    def __init__(self, config: EngineConfig, group: Any) -> None:
        super().__init__(config)
        self.group = group
        for layer in self.layers:
            attn = layer.self_attn
            attn.heads = _split(attn.heads, group.world_size, "attention heads")
            attn.kv_heads = _split(attn.kv_heads, group.world_size, "key/value heads")
            attn.qkv_proj = ColumnParallelMerged(attn.qkv_proj, group)
            attn.o_proj = RowParallelLinear(attn.o_proj, group)
            for mlp in filter(None, (layer.mlp, layer.gen_mlp)):
                mlp.gate_up_proj = ColumnParallelMerged(mlp.gate_up_proj, group)
                mlp.down_proj = RowParallelLinear(mlp.down_proj, group)
        self.embed_tokens = VocabParallelEmbedding(self.embed_tokens, group)
        self.gen_embed_tokens = VocabParallelEmbedding(self.gen_embed_tokens, group)
        self.lm_head = VocabParallelHead(self.lm_head, group)
        self.gen_head = VocabParallelHead(self.gen_head, group)

    def allocate_kv_caches(self, batch: int, max_len: int) -> list[torch.Tensor]:
        c = self.config
        shape = (2, batch, c.num_key_value_heads // self.group.world_size, max_len, c.head_dim)
        weight = self.lm_head.weight
        return [torch.zeros(shape, device=weight.device, dtype=weight.dtype) for _ in range(c.num_hidden_layers)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[str]]:
        """The single-process loader's mapping; each parallel layer's `weight_loader` takes its slice."""
        params = dict(self.named_parameters())
        filled: dict[str, list[str]] = {}
        for name, tensor in weights:
            found = self.parameter_for(name)
            if found is None:
                continue
            target, shard = found
            if target not in params:
                raise KeyError(f"engine: checkpoint tensor {name} has no parameter ({target})")
            loader = getattr(self.get_submodule(target.rsplit(".", 1)[0]), "weight_loader", None)
            if loader is not None:  # a parallel layer: its slice (biases of q|k|v too)
                loader(params[target], tensor, shard)
            else:  # norms: every rank holds them whole
                params[target].data.copy_(tensor)
            filled.setdefault(target, []).append(name)
        missing = [p for p in params if len(filled.get(p, [])) != _sources(self, p)]
        if missing:
            raise KeyError(f"engine: parameters without (all of) their checkpoint tensors: {missing}")
        return filled


def build_sharded_engine_model(
    config: EngineConfig, weights: Iterable[tuple[str, torch.Tensor]], group: Any, device: torch.device | str, dtype: torch.dtype
) -> tuple[ShardedEngineModel, dict[str, list[str]]]:
    with torch.device("meta"):
        model = ShardedEngineModel(config, group)
    model = model.to_empty(device=device).to(dtype)
    filled = model.load_weights(weights)
    return model.eval().requires_grad_(False), filled

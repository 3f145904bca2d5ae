"""The parity adapter of the Llama-style example engine (`model.py`): the second worked third-party target.

`--parity-target examples.llama_style_target.parity_target:make_target` (with this repository's
root on `PYTHONPATH`). Unlike `examples/engine_target`, this adapter registers no forward hooks: the
engine's forward returns every layer's output itself. Its stage map names the engine's own fused
modules (`attention.wqkv`, `ffn.text.w13`) and reads q and k after RoPE from the two outputs of one
joint rotary module (docs/localise.md §1). AR only; the engine policies it does not follow are
declared in `not_applicable` with the reason (docs/targets.md §5).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from examples.llama_style_target.model import PROBES, Transformer, build, read

_BLOCK = "layers.{layer}"
# Where each stage of parity's AR vocabulary is in this engine, as plain data.
STAGE_MAP: dict[str, Any] = {
    "embed": {"module": "layers.0", "input": True},
    "layer.{layer}.input_norm": f"{_BLOCK}.attention_norm",
    **{
        f"layer.{{layer}}.{part}": {"module": f"{_BLOCK}.attention.wqkv", "split": [f"layer.{{layer}}.{p}" for p in "qkv"]}
        for part in "qkv"
    },
    # one module rotates q and k together: its output is the pair (q, k), tokens-first
    "layer.{layer}.q_rope": {"module": f"{_BLOCK}.attention.rotary", "output": 0, "layout": "heads"},
    "layer.{layer}.k_rope": {"module": f"{_BLOCK}.attention.rotary", "output": 1, "layout": "heads"},
    "layer.{layer}.attn": {"module": f"{_BLOCK}.attention.wo", "input": True},
    "layer.{layer}.o_proj": f"{_BLOCK}.attention.wo",
    "layer.{layer}.post_norm": f"{_BLOCK}.ffn_norm",
    **{
        f"layer.{{layer}}.{stage}.{part}": {
            "module": f"{_BLOCK}.ffn.{ours}.w13",
            "split": [f"layer.{{layer}}.{stage}.gate", f"layer.{{layer}}.{stage}.up"],
        }
        for stage, ours in (("mlp", "text"), ("gen_mlp", "image"))
        for part in ("gate", "up")
    },
    **{
        f"layer.{{layer}}.{stage}.act": {"module": f"{_BLOCK}.ffn.{ours}.w2", "input": True}
        for stage, ours in (("mlp", "text"), ("gen_mlp", "image"))
    },
    **{f"layer.{{layer}}.{stage}.down": f"{_BLOCK}.ffn.{ours}.w2" for stage, ours in (("mlp", "text"), ("gen_mlp", "image"))},
    "layer.{layer}.moe": f"{_BLOCK}.ffn",
    "layer.{layer}.out": _BLOCK,
    "final_norm": "norm",
    "lm_head": "output",
    "gen_head": "gen_output",
}


@dataclass
class Output:
    logits: torch.Tensor  # [B, L, vocab + gen_vocab]
    hidden_states: tuple[torch.Tensor, ...]  # every block's output, before the final norm


@dataclass
class Generated:
    tokens: torch.Tensor  # [B, N]
    step_logits: torch.Tensor  # [B, N, vocab + gen_vocab]


@dataclass(frozen=True)
class Site:
    layer: int
    pre_norm: nn.Module  # ffn_norm(h) -> x
    layer_module: nn.Module  # the block: -> h + ffn(x)
    und: nn.Module
    gen: nn.Module


@dataclass(frozen=True)
class Config:
    """The upstream field names the suites and conformance read."""

    vocab_size: int
    gen_vocab_size: int
    gen_vocab_start_index: int
    hidden_size: int
    num_hidden_layers: int


class LlamaStyleAdapter:
    name = "llama-style-example"
    supports_capture = True
    capture = PROBES
    stage_map = STAGE_MAP

    def __init__(self, model: Transformer, sources: Mapping[str, list[str]]) -> None:
        self.module = model
        self.sources = dict(sources)
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        a = model.args
        self.config = Config(a.vocab_size, a.gen_vocab_size, a.gen_start, a.dim, a.n_layers)
        self.moe_layers = a.image_layers

    def moe_sites(self) -> list[Site]:
        return [
            Site(i, block.ffn_norm, block, block.ffn.text, block.ffn.image)
            for i, block in enumerate(self.module.layers)
            if block.ffn.image is not None
        ]

    def embedding_modules(self) -> tuple[nn.Module, nn.Module]:
        return self.module.tok_embeddings, self.module.gen_tok_embeddings

    def weight_name_map(self) -> dict[str, list[str]]:
        return dict(self.sources)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.module.embed(input_ids)

    @staticmethod
    def _positions(like: torch.Tensor) -> torch.Tensor:
        return torch.arange(like.shape[1], device=like.device).expand(like.shape[0], like.shape[1])

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        gen_token_mask: torch.Tensor | None = None,
    ) -> Output:
        like = input_ids if input_ids is not None else inputs_embeds
        if like is None:
            raise ValueError("forward needs input_ids or inputs_embeds")
        h, states = self.module(input_ids, self._positions(like), embeddings=inputs_embeds, gen_mask=gen_token_mask)
        return Output(self.module.logits(h), tuple(states))

    def forward_multimodal(self, inputs_embeds: torch.Tensor, input_ids: torch.Tensor) -> Output:
        return self.forward(input_ids, inputs_embeds)

    def allocate_decode_state(self, batch: int, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.caches = self.module.new_caches(batch, max_len)
        return self.caches

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.module(input_ids, self._positions(input_ids), caches=self.caches)
        return self.module.logits(h)

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h, _ = self.module(input_ids, positions[:, None], caches=self.caches)
        return self.module.logits(h)[:, 0]

    def token_of_column(self, column: torch.Tensor) -> torch.Tensor:
        vocab, start = self.config.vocab_size, self.config.gen_vocab_start_index
        return torch.where(column >= vocab, column - vocab + start, column)

    @torch.no_grad()
    def greedy_generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        step_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> Generated:
        batch, length = input_ids.shape
        if step_fn is None:
            self.allocate_decode_state(batch, length + max_new_tokens)
        logits = self.prefill(input_ids)[:, -1]
        tokens, chosen_from = [], []
        for i in range(max_new_tokens):
            token = self.token_of_column(logits.argmax(dim=-1))
            tokens.append(token)
            chosen_from.append(logits)
            if i + 1 < max_new_tokens:
                at = torch.full((batch,), length + i, dtype=torch.long, device=input_ids.device)
                logits = (step_fn or self.decode_step)(token[:, None], at)
        if not tokens:
            width = self.config.vocab_size + self.config.gen_vocab_size
            return Generated(input_ids.new_zeros(batch, 0), logits.new_zeros(batch, 0, width))
        return Generated(torch.stack(tokens, dim=1), torch.stack(chosen_from, dim=1))


class LlamaStyleTarget:
    """AR only. `not_applicable`: the engine policies of parity's AR suites this engine does not follow."""

    name = "llama-style-example"
    capture = PROBES
    not_applicable = {
        "pipeline_parallel_factory": "the engine has no pipeline parallelism",
        "eager_fast_path": "the engine blends both experts in eager too (one code path in every mode)",
    }

    def load_ar(self, checkpoint_dir: str | Path, device: torch.device | str, dtype: torch.dtype) -> LlamaStyleAdapter:
        config, tensors = read(checkpoint_dir)
        return LlamaStyleAdapter(*build(config, tensors, device, dtype))

    def build_ar(
        self, config: Any, state_dict: Mapping[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype
    ) -> LlamaStyleAdapter:
        return LlamaStyleAdapter(*build(config, state_dict.items(), device, dtype))


def make_target() -> LlamaStyleTarget:
    return LlamaStyleTarget()

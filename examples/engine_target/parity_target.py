"""The parity adapter of the example engine: what a porter writes to point parity at their model.

`--parity-target examples.engine_target.parity_target:make_target` (with this repository's root on
`PYTHONPATH`; an engine puts this file in its own package). The contract it fulfils is
docs/targets.md; every member below says which part. The engine (`engine.py`) is untouched: the
adapter only translates between parity's calls and the engine's own forward signature, and
observes the engine's fused-residual layers as they are.

An AR-only target: no `load_dit` / `build_dit` and no `router()`, so the DiT and routing suites
skip with that reason. Engine policies this engine does not follow are declared in
`not_applicable` with the reason; parity records those checks as `not_applicable` rows.

`make_target(tp=...)` (a `parity run --tp N`) returns `ShardedEngineTarget`: the same adapter over
this rank's shard of the engine (`engine_tp.py`), declaring only the stages every rank holds whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from examples.engine_target.engine import PROBES, EngineConfig, MammothEngineModel, build_engine_model, read_checkpoint
from examples.engine_target.engine_tp import build_sharded_engine_model


class AROutput(NamedTuple):
    logits: torch.Tensor  # [B, L, vocab + gen_vocab]
    hidden_states: tuple[torch.Tensor, ...]  # per decoder layer, [B, L, D], before the final norm


class GenerateOutput(NamedTuple):
    tokens: torch.Tensor  # [B, N]
    step_logits: torch.Tensor  # [B, N, vocab + gen_vocab]; step i chose tokens[:, i]


class MoESite(NamedTuple):
    layer: int
    pre_norm: nn.Module  # fused: (hidden, residual) -> (x, h)
    layer_module: nn.Module  # fused: -> (moe(x), h)
    und: nn.Module
    gen: nn.Module


# Where each stage of parity's AR vocabulary is in the engine (docs/localise.md §1), in plain data:
# fused q|k|v and gate|up are split into the reference's widths; the fused-residual norms and layers
# return (out, residual), so `output: 0` reads the first (a plain tensor, layer 0's first norm, is
# read whole). Not declared, so reported "not observable": the embeddings (a method, not a module),
# q and k after RoPE (the engine's `rotate` is a function) and the layer output (the residual add
# is fused into the next norm).
_LAYER = "layers.{layer}"
STAGE_MAP = {
    "layer.{layer}.input_norm": {"module": f"{_LAYER}.input_layernorm", "output": 0},
    **{
        f"layer.{{layer}}.{part}": {"module": f"{_LAYER}.self_attn.qkv_proj", "split": [f"layer.{{layer}}.{p}" for p in "qkv"]}
        for part in "qkv"
    },
    "layer.{layer}.attn": {"module": f"{_LAYER}.self_attn.o_proj", "input": True},
    "layer.{layer}.o_proj": f"{_LAYER}.self_attn.o_proj",
    "layer.{layer}.post_norm": {"module": f"{_LAYER}.post_attention_layernorm", "output": 0},
    **{
        f"layer.{{layer}}.{expert}.{part}": {
            "module": f"{_LAYER}.{expert}.gate_up_proj",
            "split": [f"layer.{{layer}}.{expert}.gate", f"layer.{{layer}}.{expert}.up"],
        }
        for expert in ("mlp", "gen_mlp")
        for part in ("gate", "up")
    },
    **{
        f"layer.{{layer}}.{expert}.act": {"module": f"{_LAYER}.{expert}.down_proj", "input": True}
        for expert in ("mlp", "gen_mlp")
    },
    **{f"layer.{{layer}}.{expert}.down": f"{_LAYER}.{expert}.down_proj" for expert in ("mlp", "gen_mlp")},
    "layer.{layer}.moe": {"module": _LAYER, "output": 0},
    "final_norm": {"module": "norm", "output": 0},
    "lm_head": "lm_head",
    "gen_head": "gen_head",
}


class EngineARAdapter:
    name = "engine-example"
    supports_capture = True
    capture = PROBES
    stage_map = STAGE_MAP  # optional: where parity's stages are in the engine (docs/localise.md)

    def __init__(self, model: MammothEngineModel, checkpoint_names: Mapping[str, list[str]]) -> None:
        self.module = model
        self._checkpoint_names = dict(checkpoint_names)
        self.kv_caches: list[torch.Tensor] | None = None
        # Per-layer outputs for `hidden_states`: the engine's layers return (moe_out, residual); the
        # hidden state a reference layer returns is their sum (what the next fused norm computes).
        # Hooks registered once: a forward that added and removed hooks could not be compiled.
        self._sink: list[torch.Tensor] | None = None
        for layer in model.layers:
            layer.register_forward_hook(self._record)

    def _record(self, _module: nn.Module, _args: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        if self._sink is not None:
            self._sink.append(output[0] + output[1])

    @classmethod
    def build(
        cls, config: Any, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device | str, dtype: torch.dtype
    ) -> EngineARAdapter:
        model, names = build_engine_model(EngineConfig.from_hf(config), weights, device, dtype)
        return cls(model, names)

    # ---- structure (docs/targets.md §3) ----

    @property
    def config(self) -> EngineConfig:
        return self.module.config

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.module.layers) if layer.gen_mlp is not None)

    def moe_sites(self) -> list[MoESite]:
        return [
            MoESite(i, layer.post_attention_layernorm, layer, layer.mlp, layer.gen_mlp)
            for i, layer in enumerate(self.module.layers)
            if layer.gen_mlp is not None
        ]

    def embedding_modules(self) -> tuple[nn.Module, nn.Module]:
        return self.module.embed_tokens, self.module.gen_embed_tokens

    def weight_name_map(self) -> dict[str, list[str]]:
        """Engine parameter -> the checkpoint tensors (names as in the loaded directory) it holds."""
        return dict(self._checkpoint_names)

    # ---- computation ----

    @staticmethod
    def _positions(batch: int, length: int, device: torch.device) -> torch.Tensor:
        return torch.arange(length, device=device).expand(batch, length)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.module.embed(input_ids)

    def _run(self, call: Callable[[], torch.Tensor]) -> AROutput:
        self._sink = []
        try:
            hidden = call()
            return AROutput(self.module.compute_logits(hidden), tuple(self._sink))
        finally:
            self._sink = None

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        gen_token_mask: torch.Tensor | None = None,
    ) -> AROutput:
        shaped = input_ids if input_ids is not None else inputs_embeds
        if shaped is None:
            raise ValueError("engine adapter: forward needs input_ids or inputs_embeds")
        positions = self._positions(shaped.shape[0], shaped.shape[1], shaped.device)
        return self._run(lambda: self.module(input_ids, positions, None, inputs_embeds, gen_token_mask))

    def forward_multimodal(self, inputs_embeds: torch.Tensor, input_ids: torch.Tensor) -> AROutput:
        """The engine's runner always hands the ids beside the embeddings (the mask comes from them)."""
        return self.forward(input_ids, inputs_embeds)

    def allocate_decode_state(self, batch: int, max_len: int) -> list[torch.Tensor]:
        self.kv_caches = self.module.allocate_kv_caches(batch, max_len)
        return self.kv_caches

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = self._positions(input_ids.shape[0], input_ids.shape[1], input_ids.device)
        return self.module.compute_logits(self.module(input_ids, positions, self.kv_caches))

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per sequence at `positions` [B]; capturable (static shapes, caches written in place)."""
        return self.module.compute_logits(self.module(input_ids, positions[:, None], self.kv_caches)[:, 0])

    def token_of_column(self, column: torch.Tensor) -> torch.Tensor:
        """Logits column -> token id: gen column `vocab_size + j` is token `gen_vocab_start_index + j`."""
        vocab, start = self.config.vocab_size, self.config.gen_vocab_start_index
        return torch.where(column >= vocab, column - vocab + start, column)

    @torch.no_grad()
    def greedy_generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        step_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> GenerateOutput:
        batch, length = input_ids.shape
        if step_fn is None:
            self.allocate_decode_state(batch, length + max_new_tokens)
        logits = self.prefill(input_ids)[:, -1]
        tokens, step_logits = [], []
        for i in range(max_new_tokens):
            token = self.token_of_column(logits.argmax(dim=-1))
            tokens.append(token)
            step_logits.append(logits)
            if i + 1 < max_new_tokens:
                positions = torch.full((batch,), length + i, dtype=torch.long, device=input_ids.device)
                logits = (step_fn or self.decode_step)(token[:, None], positions)
        width = self.config.vocab_size + self.config.gen_vocab_size
        if not tokens:
            return GenerateOutput(input_ids.new_zeros(batch, 0), logits.new_zeros(batch, 0, width))
        return GenerateOutput(torch.stack(tokens, dim=1), torch.stack(step_logits, dim=1))


class EngineTarget:
    """AR only. `not_applicable`: the engine policies of parity's AR suites this engine does not follow."""

    name = "engine-example"
    capture = PROBES
    not_applicable = {
        "refusal_wording": "the engine refuses capture without a mask in its own words (the refusal is still checked)",
        "probe_warning": (
            "the engine asks its capture probe only where a layer has no mask (to refuse the capture), so a "
            "forward with ids never asks and never warns"
        ),
        "raw_input_tokens_attribute": "the engine's runner always passes input_ids beside inputs_embeds; no runner flag",
        "pipeline_parallel_factory": "the engine has no pipeline parallelism",
        "eager_fast_path": "the engine runs the graph-safe blend in eager too (one code path in every mode)",
    }

    def load_ar(self, checkpoint_dir: str | Path, device: torch.device | str, dtype: torch.dtype) -> EngineARAdapter:
        config, weights = read_checkpoint(checkpoint_dir)
        return EngineARAdapter.build(config, weights, device, dtype)

    def build_ar(
        self, config: Any, state_dict: Mapping[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype
    ) -> EngineARAdapter:
        return EngineARAdapter.build(config, state_dict.items(), device, dtype)


if TYPE_CHECKING:  # the type check (tests/repo/test_types.py) holds the adapter to the contract, docs/targets.md §3
    from parity.target import ARAdapter

    _CONTRACT: type[ARAdapter] = EngineARAdapter


# The stages every rank holds whole in the tensor-parallel engine: q/k/v, the attention output and
# each expert's gate/up/act are a rank's slice, so they are left undeclared ("not observable").
WHOLE_ON_EVERY_RANK = (
    "input_norm",
    "o_proj",
    "post_norm",
    "mlp.down",
    "gen_mlp.down",
    "moe",
    "final_norm",
    "lm_head",
    "gen_head",
)
SHARDED_STAGE_MAP = {stage: where for stage, where in STAGE_MAP.items() if stage.split(".", 2)[-1] in WHOLE_ON_EVERY_RANK}


class ShardedEngineARAdapter(EngineARAdapter):
    """The same adapter over this rank's `ShardedEngineModel`: every output it returns is whole."""

    stage_map = SHARDED_STAGE_MAP

    @classmethod
    def build_sharded(
        cls, config: Any, weights: Iterable[tuple[str, torch.Tensor]], tp: Any, device: torch.device | str, dtype: torch.dtype
    ) -> ShardedEngineARAdapter:
        model, names = build_sharded_engine_model(EngineConfig.from_hf(config), weights, tp, device, dtype)
        return cls(model, names)


class ShardedEngineTarget(EngineTarget):
    """The engine at tensor-parallel size `tp.world_size` (`parity run --tp N`): this rank's shard."""

    def __init__(self, tp: Any) -> None:
        self.tp = tp
        self.name = f"engine-example-tp{tp.world_size}"

    def load_ar(self, checkpoint_dir: str | Path, device: torch.device | str, dtype: torch.dtype) -> ShardedEngineARAdapter:
        config, weights = read_checkpoint(checkpoint_dir)
        return ShardedEngineARAdapter.build_sharded(config, weights, self.tp, device, dtype)

    def build_ar(
        self, config: Any, state_dict: Mapping[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype
    ) -> ShardedEngineARAdapter:
        return ShardedEngineARAdapter.build_sharded(config, state_dict.items(), self.tp, device, dtype)


def make_target(tp: Any = None) -> EngineTarget:
    """`tp` (rank, world_size, group): given by a tensor-parallel run on every rank; None: one process."""
    return EngineTarget() if tp is None else ShardedEngineTarget(tp)

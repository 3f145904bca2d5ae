"""AR adapter of the serving target: the only surface the parity suites touch.

The AR adapter (implemented identically by `reference_models.ar.adapter.ReferenceARAdapter`):

Construction
    `load(checkpoint_dir, device="cpu", dtype=torch.float32)` (classmethod): HF-style directory.
    `build(config, state_dict, device="cpu", dtype=torch.float32)` (classmethod): in memory;
    `config` may be either package's config or any object with the upstream field names;
    `state_dict` has checkpoint (upstream) names; tensors already on `device` in `dtype` are
    adopted without a copy (the serving target copies only what it fuses).
Attributes
    `name: str`; `config` (the upstream-named config dataclass); `module` (the nn.Module);
    `moe_layers: tuple[int, ...]` (layers whose module holds a `gen_mlp`, read from the module);
    `capture` (a capture-probe registry: `register_capture_probe`, `capture_probe`,
    `is_capturing`); `supports_capture: bool` (False for the reference: it reads masks on the host).
Observation points (real submodules whose forward runs, so hooks fire)
    `moe_sites() -> list[MoESite]`, one per MoE layer: `pre_norm` (post_attention_layernorm; its
    output is the MoE input x, its input the residual h), `layer_module` (output `h + moe(x)`),
    `und` (`mlp`) and `gen` (`gen_mlp`), each callable on `[..., D]`.
    `embedding_modules() -> (base_embedding, gen_embedding)`: their forward receives the lookup
    indices (serving: clamped indices on every token; reference: upstream's lookup).
    `weight_name_map() -> dict[str, list[str]]`: module parameter -> checkpoint tensors.
Computation (no autograd)
    `embed(input_ids) -> [B, L, D]`.
    `forward(input_ids=None, inputs_embeds=None, gen_token_mask=None) -> AROutput(logits [B, L,
    vocab + gen_vocab], hidden_states: per-decoder-layer outputs [B, L, D] before the final norm)`.
    With `inputs_embeds` and neither ids nor mask the mask is None: eager runs `mlp` everywhere
    (upstream's hazard); under capture the serving target raises (fails closed).
    `forward_multimodal(inputs_embeds, input_ids) -> AROutput`: the runner's multimodal entry.
    `allocate_decode_state(batch, max_len)`; `prefill(input_ids [B, L]) -> logits [B, L, V]` fills
    positions [0, L); `decode_step(input_ids [B, 1], positions [B]) -> logits [B, V]` writes
    position `positions` and attends to [0, positions]. The serving decode step is capturable:
    no host reads, static shapes, the KV cache updated in place, the mask re-derived from the
    step's ids. Capture it before `prefill` (tracing really runs it, writing the dummy step's
    k/v at the dummy positions).
    `greedy_generate(input_ids, max_new_tokens, step_fn=None) -> GenerateOutput(tokens [B, N],
    step_logits [B, N, V])`; `step_logits[:, i]` chose `tokens[:, i]`. `step_fn` replaces
    `decode_step` (e.g. a captured graph's replay) and must use this adapter's decode state.
Mask-keyed decode graphs (serving only; a target without them captures one decode graph)
    `decode_graph_keys` (`("und_only", "gen_only", "blend")`): the graphs a runner captures per batch size.
    `select_decode_graph(key)`: host-side, what `decode_step` runs from now on, and so what a
    capture bakes; a runner calls it from its `host_prepare` hook (before recording and before
    each replay of that key's graph). `und_only`: the und expert alone, gen tokens poisoned to
    NaN; `gen_only`: the gen expert alone in the MoE layers, text tokens poisoned to NaN;
    `blend`: the graph-safe blend (the default, restored by `select_decode_graph(None)`).
    `decode_graph_key(generating) -> key`: the graph a batch replays, from per-request host
    state (per row: True feeds a gen token this step, False a text token, None not known);
    never a device read.
Fused kernels (serving only, optional)
    `unfused_kernels()`: a context in which forwards run the torch ops the fused CUDA decode
    kernels replace (`serving_models/ar/kernels.py`); the benchmark times both.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from serving_models.ar import kernels
from serving_models.ar import runner as ar_runner
from serving_models.ar import weights as ar_weights
from serving_models.ar.config import MammothModa2ARConfig
from serving_models.ar.model import AR_WRAPPERS, MammothModa2ForConditionalGeneration, StaticKVCache
from serving_models.common import capture


@dataclass(frozen=True)
class MoESite:
    layer: int
    pre_norm: nn.Module
    layer_module: nn.Module
    und: nn.Module
    gen: nn.Module


@dataclass
class AROutput:
    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]


@dataclass
class GenerateOutput:
    tokens: torch.Tensor
    step_logits: torch.Tensor


class LayerOutputs:
    """Collects each decoder layer's output while a full-sequence forward runs.

    The hooks are registered once, at construction: a forward that registered and removed hooks
    itself could not be traced by torch.compile (`RemovableHandle` bookkeeping is a graph break),
    while persistent hooks and a list that a forward fills are ordinary traced Python. Between
    forwards (prefill, decode steps) the hooks record nothing.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.sink: list[torch.Tensor] | None = None
        self.handles = [m.register_forward_hook(self._record) for m in modules]

    def _record(self, _module: nn.Module, _args: tuple, output: torch.Tensor) -> None:
        if self.sink is not None:
            self.sink.append(output)

    def run(self, call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        self.sink = []
        try:
            result = call()
            return result, tuple(self.sink)
        finally:
            self.sink = None


class traceable_method:
    """A method that binds as `functools.partial(fn, self)` instead of a bound method.

    `make_fx(adapter.decode_step)` counts the positional parameters of the callable's code; a bound
    method's code still lists `self`, so tracing it fails with "expected 3 arguments but got 2".
    A partial traces with exactly the call's arguments. (A subclass overriding such a method
    should decorate its override too.)
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj: object, objtype: type | None = None) -> Callable:
        return self.fn if obj is None else functools.partial(self.fn, obj)


# Where each stage of parity's AR vocabulary is in this model (paths under `module`): fused q|k|v
# and gate|up are split into the reference's widths; q is rotated by `rope` in a full forward and
# inside the cache-write kernel in a decode step (the first of the two that ran is read).
_LAYER = "ar.language_model.model.layers.{layer}"
_ROPE = {"module": f"{_LAYER}.self_attn.rope", "layout": "heads", "split": ["layer.{layer}.q_rope", "layer.{layer}.k_rope"]}
STAGE_MAP = {
    "embed": {"module": "ar.language_model.model.layers.0", "input": True},
    "layer.{layer}.input_norm": f"{_LAYER}.input_layernorm",
    **{
        f"layer.{{layer}}.{part}": {"module": f"{_LAYER}.self_attn.qkv_proj", "split": [f"layer.{{layer}}.{p}" for p in "qkv"]}
        for part in "qkv"
    },
    "layer.{layer}.q_rope": [_ROPE, {"module": f"{_LAYER}.self_attn.rope_cache_write", "layout": "heads"}],
    "layer.{layer}.k_rope": _ROPE,
    "layer.{layer}.attn": {"module": f"{_LAYER}.self_attn.o_proj", "input": True},
    "layer.{layer}.o_proj": f"{_LAYER}.self_attn.o_proj",
    "layer.{layer}.post_norm": f"{_LAYER}.post_attention_layernorm",
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
    "layer.{layer}.moe": f"{_LAYER}.experts",
    "layer.{layer}.out": _LAYER,
    "final_norm": "ar.language_model.model.norm",
    "lm_head": "ar.language_model.lm_head",
    "gen_head": "ar.language_model.gen_head",
}


class ServingARAdapter:
    name = "serving"
    supports_capture = True
    capture = capture
    stage_map = STAGE_MAP

    decode_graph_keys = ar_runner.DECODE_GRAPH_KEYS

    def __init__(self, module: MammothModa2ForConditionalGeneration) -> None:
        self.module = module
        self.decode_state: StaticKVCache | None = None
        self.decode_only_expert: str | None = None  # host state: the key `decode_step` runs (and a capture bakes)
        self._layer_outputs = LayerOutputs(list(self._layers))

    @classmethod
    def load(
        cls, checkpoint_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> ServingARAdapter:
        return cls(ar_weights.from_pretrained(checkpoint_dir, device, dtype))

    @classmethod
    def build(
        cls,
        config: object,
        state_dict: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> ServingARAdapter:
        return cls(ar_weights.build_model(config, state_dict, device, dtype))

    # ---- structure ----

    @property
    def config(self) -> MammothModa2ARConfig:
        return self.module.config

    @property
    def _lm(self):
        return self.module.language_model

    @property
    def _layers(self) -> nn.ModuleList:
        return self._lm.model.layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self._layers) if layer.gen_mlp is not None)

    def moe_sites(self) -> list[MoESite]:
        return [
            MoESite(i, layer.post_attention_layernorm, layer, layer.mlp, layer.gen_mlp)
            for i, layer in enumerate(self._layers)
            if layer.gen_mlp is not None
        ]

    @staticmethod
    def ar_wrapper_classes() -> list[type[nn.Module]]:
        """Every AR wrapper a runner may hold (Qwen2.5 and Qwen3 backbones): each must declare
        `requires_raw_input_tokens`, or the multimodal path drops the ids (vllm-project/vllm-omni#9851)."""
        return list(AR_WRAPPERS.values())

    def embedding_modules(self) -> tuple[nn.Module, nn.Module | None]:
        return self._lm.model.embed_tokens, self._lm.model.gen_embed_tokens

    def weight_name_map(self) -> dict[str, list[str]]:
        return ar_weights.weight_name_map(self.module)

    @property
    def _device(self) -> torch.device:
        return self._lm.lm_head.weight.device

    @property
    def _dtype(self) -> torch.dtype:
        return self._lm.lm_head.weight.dtype

    # ---- full-sequence computation ----

    @staticmethod
    def _positions(batch: int, length: int, device: torch.device) -> torch.Tensor:
        return torch.arange(length, device=device).expand(batch, length)

    # embed / forward / forward_multimodal carry no `torch.no_grad()` decorator: the weights have
    # requires_grad=False, so no autograd graph is built anyway, and a decorator would make every
    # method one shared wrapper code object to torch.compile, whose cache entries then all count
    # against a single recompile limit.

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.module.get_input_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        gen_token_mask: torch.Tensor | None = None,
    ) -> AROutput:
        shaped = input_ids if input_ids is not None else inputs_embeds
        positions = self._positions(shaped.shape[0], shaped.shape[1], shaped.device)
        hidden, layer_outputs = self._layer_outputs.run(
            lambda: self.module(input_ids, positions, inputs_embeds=inputs_embeds, gen_token_mask=gen_token_mask)
        )
        return AROutput(self.module.compute_logits(hidden), layer_outputs)

    def forward_multimodal(self, inputs_embeds: torch.Tensor, input_ids: torch.Tensor) -> AROutput:
        positions = self._positions(input_ids.shape[0], input_ids.shape[1], input_ids.device)
        logits, layer_outputs = self._layer_outputs.run(
            lambda: ar_runner.execute_model(self.module, input_ids, inputs_embeds, positions)
        )
        return AROutput(logits, layer_outputs)

    # ---- decoding over the static KV cache ----

    def allocate_decode_state(self, batch: int, max_len: int) -> StaticKVCache:
        self.decode_state = StaticKVCache.allocate(self.config, batch, max_len, self._device, self._dtype)
        return self.decode_state

    def _require_state(self, batch: int, length: int) -> StaticKVCache:
        state = self.decode_state
        if state is None or state.batch != batch or state.max_len < length:
            have = None if state is None else (state.batch, state.max_len)
            raise ValueError(
                f"decode state (batch, max_len) = {have} cannot hold batch {batch} up to length {length}; "
                "call allocate_decode_state first"
            )
        return state

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch, length = input_ids.shape
        state = self._require_state(batch, length)
        positions = self._positions(batch, length, input_ids.device)
        return self.module.compute_logits(self.module(input_ids, positions, kv_cache=state))

    @staticmethod
    def decode_graph_key(generating: Sequence[bool | None]) -> str:
        """The decode graph for a batch whose rows feed a gen token (True), a text token (False) or
        a token the host does not know (None) this step."""
        return ar_runner.decode_graph_key(generating)  # looked up at call time: one replaceable decision

    def select_decode_graph(self, key: str | None) -> None:
        """Host-side: run (and let a capture bake) decode graph `key` from the next `decode_step` on;
        None restores the default, the blend (correct for any batch)."""
        if key is not None and key not in self.decode_graph_keys:
            raise ValueError(f"unknown decode graph key {key!r}; keys are {self.decode_graph_keys}")
        self.decode_only_expert = ar_runner.ONLY_EXPERT[key or ar_runner.BLEND]

    @staticmethod
    def unfused_kernels() -> contextlib.AbstractContextManager[None]:
        """Forwards (and captures) inside run the torch ops the fused decode kernels replace."""
        return kernels.unfused()

    @traceable_method
    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per sequence; graph-capturable (static shapes, in-place cache, no host reads).

        Runs the decode graph selected on the host (`select_decode_graph`; a capture bakes it).
        No `torch.no_grad()` here (the weights have `requires_grad=False`), so a tracer sees
        exactly this computation.
        """
        hidden = self.module(input_ids, positions[:, None], kv_cache=self.decode_state, only_expert=self.decode_only_expert)
        return self.module.compute_logits(hidden[:, 0])

    @torch.no_grad()
    def greedy_generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        step_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> GenerateOutput:
        batch, length = input_ids.shape
        state = self.decode_state
        if step_fn is not None:
            self._require_state(batch, length + max_new_tokens)  # a captured step is bound to this state
        elif state is None or state.batch != batch or state.max_len < length + max_new_tokens:
            self.allocate_decode_state(batch, length + max_new_tokens)
        step = step_fn or self.decode_step
        logits = self.prefill(input_ids)[:, -1]
        tokens, step_logits = [], []
        for i in range(max_new_tokens):
            token = self.config.token_of_column(logits.argmax(dim=-1))
            tokens.append(token)
            step_logits.append(logits)
            if i + 1 < max_new_tokens:
                positions = torch.full((batch,), length + i, dtype=torch.long, device=input_ids.device)
                logits = step(token[:, None], positions)
        if not tokens:
            width = self.config.logits_width
            empty_logits = torch.zeros(batch, 0, width, dtype=self._dtype, device=self._device)
            return GenerateOutput(input_ids.new_zeros(batch, 0), empty_logits)
        return GenerateOutput(torch.stack(tokens, dim=1), torch.stack(step_logits, dim=1))

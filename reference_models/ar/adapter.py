"""AR adapter of the reference: the same surface as `serving_models.ar.adapter.ServingARAdapter`.

See that module's docstring for the full adapter API; the reference implements every member
with upstream semantics:

- `forward` / `greedy_generate`: upstream's eager model; greedy decoding by full recompute, the
  mask re-derived from all ids at every step.
- `forward_multimodal(inputs_embeds, input_ids)`: upstream's outer VL model (mask from the ids,
  passed down with the embeddings).
- `allocate_decode_state` / `prefill` / `decode_step`: the token history is the state and each
  step recomputes the whole sequence (numerically upstream's generate). Eager only:
  `supports_capture` is False and `capture` is a registry that never reports capturing.
- `embedding_modules()`: called the upstream way (gen positions get index 0 in `embed_tokens`;
  `gen_embed_tokens` sees only the gen rows' offsets).
- `weight_name_map()`: module names are checkpoint names (spelt with the release's prefixes for a release directory).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from reference_models import families
from reference_models.ar.config import MammothModa2ARConfig
from reference_models.ar.model import MammothModa2ForCausalLM, derive_gen_token_mask
from reference_models.common import capture

# Where each stage of parity's AR vocabulary is in the reference: module paths under `module`
# (a plain path reads the module's output; docs/localise.md §1 has the declaration's form).
_LAYER = "model.layers.{layer}"
STAGE_MAP = {
    "embed": {"module": "model.layers.0", "input": True},
    "layer.{layer}.input_norm": f"{_LAYER}.input_layernorm",
    "layer.{layer}.q": f"{_LAYER}.self_attn.q_proj",
    "layer.{layer}.k": f"{_LAYER}.self_attn.k_proj",
    "layer.{layer}.v": f"{_LAYER}.self_attn.v_proj",
    "layer.{layer}.q_rope": {"module": f"{_LAYER}.self_attn.rotary", "output": 0, "layout": "heads_first"},
    "layer.{layer}.k_rope": {"module": f"{_LAYER}.self_attn.rotary", "output": 1, "layout": "heads_first"},
    "layer.{layer}.attn": {"module": f"{_LAYER}.self_attn.o_proj", "input": True},
    "layer.{layer}.o_proj": f"{_LAYER}.self_attn.o_proj",
    "layer.{layer}.post_norm": f"{_LAYER}.post_attention_layernorm",
    **{
        f"layer.{{layer}}.{expert}.{name}": {"module": f"{_LAYER}.{expert}.{module}", "input": name == "act"}
        for expert in ("mlp", "gen_mlp")
        for name, module in (("gate", "gate_proj"), ("up", "up_proj"), ("act", "down_proj"), ("down", "down_proj"))
    },
    "layer.{layer}.moe": f"{_LAYER}.moe",
    "layer.{layer}.out": _LAYER,
    "final_norm": "model.norm",
    "lm_head": "lm_head",
    "gen_head": "gen_head",
}


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


class ReferenceARAdapter:
    name = "reference"
    supports_capture = False
    capture = capture
    stage_map = STAGE_MAP

    def __init__(self, module: MammothModa2ForCausalLM) -> None:
        self.module = module.eval().requires_grad_(False)
        self._history: torch.Tensor | None = None
        self._max_len = 0

    @classmethod
    def load(
        cls, checkpoint_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> ReferenceARAdapter:
        """From a parity or a release directory; the other families' tensors (`families.others`)
        are theirs, not read."""
        return cls(MammothModa2ForCausalLM.from_pretrained(checkpoint_dir, device, dtype, others=families.others("ar")))

    @classmethod
    def build(
        cls,
        config: MammothModa2ARConfig,
        state_dict: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> ReferenceARAdapter:
        return cls(MammothModa2ForCausalLM.from_state_dict(config, state_dict, device, dtype))

    # ---- structure ----

    @property
    def config(self) -> MammothModa2ARConfig:
        return self.module.config

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.module.model.layers) if layer.gen_mlp is not None)

    def moe_sites(self) -> list[MoESite]:
        return [
            MoESite(i, layer.post_attention_layernorm, layer, layer.mlp, layer.gen_mlp)
            for i, layer in enumerate(self.module.model.layers)
            if layer.gen_mlp is not None
        ]

    def embedding_modules(self) -> tuple[nn.Module, nn.Module | None]:
        return self.module.model.embed_tokens, self.module.model.gen_embed_tokens

    def weight_name_map(self) -> dict[str, list[str]]:
        """Module names are parity's checkpoint names; a release directory spells them with its prefixes."""
        spelt = getattr(self.module, "checkpoint_file_names", {})
        return {name: [spelt.get(name, name)] for name, _ in self.module.named_parameters()}

    # ---- full-sequence computation ----

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = derive_gen_token_mask(input_ids, self.config.gen_vocab_start_index)
        return self.module.model.embed_input_ids(input_ids, mask)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        gen_token_mask: torch.Tensor | None = None,
    ) -> AROutput:
        out = self.module(input_ids=input_ids, inputs_embeds=inputs_embeds, gen_token_mask=gen_token_mask)
        return AROutput(out.logits, out.hidden_states)

    @torch.no_grad()
    def forward_multimodal(self, inputs_embeds: torch.Tensor, input_ids: torch.Tensor) -> AROutput:
        out = self.module.forward_multimodal(input_ids, inputs_embeds)
        return AROutput(out.logits, out.hidden_states)

    # ---- decoding (full recompute over the token history) ----

    def allocate_decode_state(self, batch: int, max_len: int) -> None:
        self._history = torch.empty(batch, 0, dtype=torch.long)
        self._max_len = max_len

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._history is None or self._history.shape[0] != input_ids.shape[0] or input_ids.shape[1] > self._max_len:
            raise ValueError(f"prefill of {tuple(input_ids.shape)} does not fit the decode state; allocate it first")
        self._history = input_ids.clone()
        return self.module(input_ids=input_ids).logits

    @torch.no_grad()
    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._history is None:
            raise ValueError("decode_step before prefill")
        length = self._history.shape[1]
        if not bool((positions == length).all()) or length + 1 > self._max_len:
            raise ValueError(
                f"decode_step at positions {positions.tolist()}: the reference state holds {length} tokens "
                f"(max_len {self._max_len}); steps must be consecutive"
            )
        self._history = torch.cat([self._history, input_ids], dim=1)
        return self.module(input_ids=self._history).logits[:, -1]

    @torch.no_grad()
    def greedy_generate(self, input_ids: torch.Tensor, max_new_tokens: int, step_fn=None) -> GenerateOutput:
        if step_fn is not None:
            raise ValueError("the reference has no captured step to replay; step_fn must be None")
        tokens, step_logits = self.module.greedy_generate(input_ids, max_new_tokens)
        return GenerateOutput(tokens, step_logits)

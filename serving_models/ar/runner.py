"""The slice of a model runner that decides what reaches the AR module: its inputs and the decode graph.

On the multimodal path a vLLM-style runner embeds the prompt itself (text embeddings with image
features scattered in) and calls `forward` with `inputs_embeds`; it drops `input_ids` unless the
module declares `requires_raw_input_tokens`. Without the ids the MoE layers get no mask and the
gen expert never runs (vllm-project/vllm-omni#9851), so this attribute is load-bearing, and this function is
the one place that reads it.

Decode graphs are mask-keyed (the follow-up vllm-project/vllm-omni#9865 names): per batch size the
runner captures an und-only graph (the und expert alone, no blend: what a single-expert model
costs), a gen-only graph (the gen expert alone in the MoE layers: what an all-image batch needs)
and the blended graph (both experts, per-token select on the device), and before each replay
picks one from host-side request state (`decode_graph_key`), never from the device mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from serving_models.ar.model import GEN, UND

UND_ONLY = "und_only"
GEN_ONLY = "gen_only"
BLEND = "blend"
DECODE_GRAPH_KEYS = (UND_ONLY, GEN_ONLY, BLEND)
# the expert each key runs alone in the MoE layers (the forward's `only_expert`); None: the blend
ONLY_EXPERT = {UND_ONLY: UND, GEN_ONLY: GEN, BLEND: None}


def prepare_model_inputs(
    model: nn.Module, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None
) -> dict[str, torch.Tensor | None]:
    """The `input_ids` / `inputs_embeds` pair the runner passes to `model.forward`."""
    if inputs_embeds is None:
        return {"input_ids": input_ids, "inputs_embeds": None}
    keep_ids = bool(getattr(model, "requires_raw_input_tokens", False))
    return {"input_ids": input_ids if keep_ids else None, "inputs_embeds": inputs_embeds}


def execute_model(
    model: nn.Module,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One runner step without a KV cache: forward through `prepare_model_inputs`, then logits."""
    hidden_states = model(positions=positions, **prepare_model_inputs(model, input_ids, inputs_embeds))
    return model.compute_logits(hidden_states)


def decode_graph_key(generating: Sequence[bool | None]) -> str:
    """The decode graph a batch replays, from the host's per-request state of this step's token:
    `True` the request feeds a gen token (a text-to-image request inside its image: its sampler is
    restricted to the gen vocabulary, docs/model.md §4), `False` a text token, `None` the host
    does not know (a request that may have sampled `image_start`). `und_only` when every row is
    known text, `gen_only` when every row is known gen, `blend` otherwise (and for a mix).

    Python values only: a device tensor is refused, because reading it would be the host sync
    the keyed graphs exist to avoid.
    """
    if isinstance(generating, torch.Tensor):
        raise TypeError(
            "decode_graph_key takes host-side request state (Python bools); a tensor would need a "
            "device-to-host sync before every replay"
        )
    flags = [None if flag is None else bool(flag) for flag in generating]
    if all(flag is False for flag in flags):
        return UND_ONLY
    if all(flag is True for flag in flags):
        return GEN_ONLY
    return BLEND

"""The slice of a model runner that decides what reaches the AR module: its inputs and the decode graph.

On the multimodal path a vLLM-style runner embeds the prompt itself (text embeddings with image
features scattered in) and calls `forward` with `inputs_embeds`; it drops `input_ids` unless the
module declares `requires_raw_input_tokens`. Without the ids the MoE layers get no mask and the
gen expert never runs (vllm-project/vllm-omni#9851), so this attribute is load-bearing, and this function is
the one place that reads it.

Decode graphs are mask-keyed (the follow-up vllm-project/vllm-omni#9865 names): per batch size the
runner captures an und-only graph (the und expert alone, no blend: what a single-expert model
costs) and the blended graph (both experts, per-token select on the device), and before each
replay picks one from host-side request state (`decode_graph_key`), never from the device mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

UND_ONLY = "und_only"
BLEND = "blend"
DECODE_GRAPH_KEYS = (UND_ONLY, BLEND)


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


def decode_graph_key(generating: Sequence[bool]) -> str:
    """The decode graph a batch replays, from the host's per-request state: `blend` as soon as one
    request may feed a gen token this step (it is generating an image), `und_only` otherwise.

    `generating` holds Python bools the engine keeps per request; a device tensor is refused,
    because reading it would be the host sync the keyed graphs exist to avoid.
    """
    if isinstance(generating, torch.Tensor):
        raise TypeError(
            "decode_graph_key takes host-side request state (Python bools); a tensor would need a "
            "device-to-host sync before every replay"
        )
    return BLEND if any(bool(flag) for flag in generating) else UND_ONLY

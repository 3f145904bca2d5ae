"""The slice of a model runner that decides which inputs reach the AR module's `forward`.

On the multimodal path a vLLM-style runner embeds the prompt itself (text embeddings with image
features scattered in) and calls `forward` with `inputs_embeds`; it drops `input_ids` unless the
module declares `requires_raw_input_tokens`. Without the ids the MoE layers get no mask and the
gen expert never runs (vllm-project/vllm-omni#9851), so this attribute is load-bearing, and this function is
the one place that reads it.
"""

from __future__ import annotations

import torch
from torch import nn


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

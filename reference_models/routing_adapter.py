"""The MoE-router adapter of the reference (the truth the `routing` suite compares against).

Same class shape as `serving_models/routing_adapter.py` (see its docstring for the contract):
`name`, `RoutingResult`, `SwiGLUExperts`, `select_experts(...)`, `make_experts(...)`,
`apply_experts(x, result, experts)`, `remap(ids, replica_table, row_choice)`,
`expert_load(ids, num_valid_rows, num_physical)`. The reference additionally accepts
`golden=True` on `select_experts` (fp64 weights for the same experts), a Python int for
`num_valid_rows`, and offers `routing_margins(...)` for the near-tie audit.
Factory: `make_router()`.
"""

from __future__ import annotations

import torch

from reference_models import moe_experts, routing


class ReferenceRouter:
    """Plain per-row reference router."""

    name = "reference"
    RoutingResult = routing.RoutingResult
    RoutingMargins = routing.RoutingMargins
    SwiGLUExperts = moe_experts.SwiGLUExperts

    def select_experts(
        self,
        logits: torch.Tensor,
        k: int,
        *,
        scoring: str = "softmax",
        renormalize: bool,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        correction_bias: torch.Tensor | None = None,
        routed_scaling_factor: float = 1.0,
        num_shared_experts: int = 0,
        shared_weight_mode: str = "folded",
        num_valid_rows: torch.Tensor | int | None = None,
        golden: bool = False,
    ) -> routing.RoutingResult:
        return routing.select_experts(
            logits, k, scoring=scoring, renormalize=renormalize, num_expert_group=num_expert_group,
            topk_group=topk_group, correction_bias=correction_bias,
            routed_scaling_factor=routed_scaling_factor, num_shared_experts=num_shared_experts,
            shared_weight_mode=shared_weight_mode, num_valid_rows=num_valid_rows, golden=golden,
        )

    def routing_margins(
        self,
        logits: torch.Tensor,
        k: int,
        *,
        scoring: str = "softmax",
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        correction_bias: torch.Tensor | None = None,
    ) -> routing.RoutingMargins:
        return routing.routing_margins(
            logits, k, scoring=scoring, num_expert_group=num_expert_group, topk_group=topk_group,
            correction_bias=correction_bias,
        )

    def make_experts(self, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor) -> moe_experts.SwiGLUExperts:
        return moe_experts.SwiGLUExperts(gate_proj, up_proj, down_proj)

    def apply_experts(self, x: torch.Tensor, result: tuple[torch.Tensor, torch.Tensor], experts: object) -> torch.Tensor:
        weights, ids = result
        return moe_experts.apply_experts(x, weights, ids, experts)

    def remap(self, ids: torch.Tensor, replica_table: torch.Tensor, row_choice: torch.Tensor) -> torch.Tensor:
        return routing.remap(ids, replica_table, row_choice)

    def expert_load(self, ids: torch.Tensor, num_valid_rows: torch.Tensor | int | None, num_physical: int) -> torch.Tensor:
        return routing.expert_load(ids, num_valid_rows, num_physical)


def make_router() -> ReferenceRouter:
    return ReferenceRouter()

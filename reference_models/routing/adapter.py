"""The MoE-router adapter of the reference (the truth the `routing` suite compares against).

Same class shape as `serving_models/routing/adapter.py` (see its docstring for the contract):
`name`, `RoutingResult`, `SwiGLUExperts`, `select_experts(...)`, `make_experts(...)`,
`apply_experts(x, result, experts)`, `remap(ids, replica_table, row_choice)`,
`expert_load(ids, num_valid_rows, num_physical)`. The reference additionally accepts
`golden=True` on `select_experts` (fp64 weights for the same experts), a Python int for
`num_valid_rows`, and offers `routing_margins(...)` for the near-tie audit. It reads counts on
the host, so graph modes do not apply to it (`supports_capture = False`). The multi-rank entry
points `route_then_gather` / `gather_then_route` are written plainly: route or gather, then pad
each rank's block to `capacity` rows and `all_gather` it; counts are read on the host.
Factory: `make_router()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference_models.routing import experts as moe_experts
from reference_models.routing import router as routing


@dataclass(frozen=True)
class GatheredRoutes:
    """All ranks' rows after the gather, rank-major, `capacity` rows a rank."""

    hidden: torch.Tensor  # [W * C, H]
    weights: torch.Tensor  # fp32 [W * C, k + S]
    ids: torch.Tensor  # int32 [W * C, k + S]
    counts: torch.Tensor  # int64 [W]: each rank's real rows


def _gather_padded(tensor: torch.Tensor, capacity: int, fill: float, group) -> torch.Tensor:
    """Every rank's `tensor` padded to `capacity` rows with `fill`, concatenated in rank order."""
    if tensor.shape[0] > capacity:
        raise ValueError(f"reference router: {tensor.shape[0]} local rows exceed the capacity {capacity}")
    padded = torch.full((capacity, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts)


# Where each stage of parity's routing vocabulary is in the reference (docs/localise.md §1): the
# keys and scores of every row at once, the selection row by row (the per-row calls stack into a
# table of the real rows), the output of `select_experts`. With `golden=True` the same functions
# give fp64 scores and weights for the experts its fp32 keys select.
_ROUTER = "reference_models.routing.router"
STAGE_MAP = {
    "scores": {"function": f"{_ROUTER}:weight_scores"},
    "keys": {"function": f"{_ROUTER}:_row_keys", "output": 0},
    "group_mask": {"function": f"{_ROUTER}:group_keep", "output": 0},
    "topk_ids": {"function": f"{_ROUTER}:route_row", "output": 0},
    "weights": {"function": f"{_ROUTER}:route_row", "output": 1},
    "masked_ids": {"function": f"{_ROUTER}:select_experts", "output": 1},
    "masked_weights": {"function": f"{_ROUTER}:select_experts", "output": 0},
}


class ReferenceRouter:
    """Plain per-row reference router."""

    name = "reference"
    supports_capture = False
    stage_map = STAGE_MAP
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
            logits,
            k,
            scoring=scoring,
            renormalize=renormalize,
            num_expert_group=num_expert_group,
            topk_group=topk_group,
            correction_bias=correction_bias,
            routed_scaling_factor=routed_scaling_factor,
            num_shared_experts=num_shared_experts,
            shared_weight_mode=shared_weight_mode,
            num_valid_rows=num_valid_rows,
            golden=golden,
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
            logits,
            k,
            scoring=scoring,
            num_expert_group=num_expert_group,
            topk_group=topk_group,
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

    def route_then_gather(
        self,
        local_hidden: torch.Tensor,
        local_logits: torch.Tensor,
        local_n_valid: torch.Tensor | int,
        k: int,
        *,
        capacity: int,
        group=None,
        **options,
    ) -> GatheredRoutes:
        """Route this rank's rows (pad rows -1 / 0), then gather rows with their ids and weights."""
        count = routing.count_real_rows(local_n_valid, local_logits.shape[0])
        routed = routing.select_experts(local_logits, k, num_valid_rows=count, **options)
        counts = torch.tensor([count], dtype=torch.int64, device=local_logits.device)
        return GatheredRoutes(
            hidden=_gather_padded(local_hidden, capacity, 0.0, group),
            weights=_gather_padded(routed.weights, capacity, 0.0, group),
            ids=_gather_padded(routed.ids, capacity, routing.NO_EXPERT, group),
            counts=_gather_padded(counts, 1, 0, group),
        )

    def gather_then_route(
        self,
        local_hidden: torch.Tensor,
        local_logits: torch.Tensor,
        local_n_valid: torch.Tensor | int,
        k: int,
        *,
        capacity: int,
        group=None,
        **options,
    ) -> GatheredRoutes:
        """Gather the raw rows and counts, route every gathered row, then clear each rank's pad rows."""
        count = routing.count_real_rows(local_n_valid, local_logits.shape[0])
        counts = _gather_padded(torch.tensor([count], dtype=torch.int64, device=local_logits.device), 1, 0, group)
        routed = routing.select_experts(_gather_padded(local_logits, capacity, float("nan"), group), k, **options)
        weights, ids = routed.weights.clone(), routed.ids.clone()
        for rank, real in enumerate(counts.cpu().tolist()):
            weights[rank * capacity + real : (rank + 1) * capacity] = 0.0
            ids[rank * capacity + real : (rank + 1) * capacity] = routing.NO_EXPERT
        return GatheredRoutes(_gather_padded(local_hidden, capacity, 0.0, group), weights, ids, counts)


def make_router() -> ReferenceRouter:
    return ReferenceRouter()

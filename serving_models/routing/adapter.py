"""The MoE-router adapter of the serving target (what the `routing` suite calls).

Adapter class shape (the same in `reference_models/routing/adapter.py`; `parity/target.py` declares it
as a Protocol). An adapter object has:

    name: str
    RoutingResult                   # NamedTuple type with fields (weights, ids), in that order
    SwiGLUExperts                   # weight container: gate_proj/up_proj [N, I, H], down_proj [N, H, I]

    select_experts(logits [T, E], k, *, scoring="softmax" | "sigmoid", renormalize: bool,
                   num_expert_group=None, topk_group=None, correction_bias=None,
                   routed_scaling_factor=1.0, num_shared_experts=0,
                   shared_weight_mode="folded" | "unfolded", num_valid_rows=None)
        -> RoutingResult(weights fp32 [T, k+S], ids int32 [T, k+S])
        num_valid_rows: int device tensor (first element = real rows, clamped to [0, T]); rows
        past it are -1 / 0 in every column. "folded": routed weights include the scaling factor,
        shared weight 1.0; "unfolded": routed weights exclude it, shared weight 1/factor.
    make_experts(gate_proj, up_proj, down_proj) -> SwiGLUExperts
    apply_experts(x [T, H], result: RoutingResult, experts) -> [T, H]
        weighted sum of SwiGLU experts; -1 slots contribute nothing; `experts` is any object
        with gate_proj / up_proj / down_proj (routed experts first, then shared ones at E + i).
    remap(ids [T, K], replica_table [E, R], row_choice [T]) -> physical ids [T, K]
        replica_table[e] lists e's physical replicas (a prefix, -1 padded); row r takes replica
        row_choice[r] mod replicas(e); -1 and ids outside [0, E) pass through.
    expert_load(ids [T, K], num_valid_rows, num_physical) -> int64 [num_physical]
        routes per physical expert, ids in [0, num_physical) on rows < n_valid only.
    supports_capture: bool          # False: graph modes do not apply (the reference reads on the host)

Optional, for the multi-rank check (the `rank-` cases skip a router without them); each runs
inside an initialised `torch.distributed` process group and returns an object with `hidden
[W*C, H]`, `weights [W*C, k+S]`, `ids [W*C, k+S]`, `counts [W]` (rank-major, `capacity` rows a
rank, pad rows -1 / 0):

    route_then_gather(local_hidden [T, H], local_logits [T, E], local_n_valid, k, *, capacity,
                      group=None, **select_experts options)
        route this rank's rows with its own device-side count, then gather rows with their ids
        and weights (ROCm/ATOM#2725).
    gather_then_route(same arguments)
        gather the raw rows and counts, route every gathered row, mask each rank's pad rows.

The serving implementation is graph-safe: no host reads, static shapes. Factory: `make_router()`.
"""

from __future__ import annotations

import torch

from serving_models.routing import distributed as routing_distributed
from serving_models.routing import experts as moe_experts
from serving_models.routing import router as routing

# Where each stage of parity's routing vocabulary is in this router (docs/localise.md §1): the
# module-level functions of `serving_models.routing.router` that produce it, read in eager runs.
# Softmax and sigmoid routing run different functions; the first of the alternatives the run called
# is read (the keys: the grouped mask's input, else the ranking's input, which without groups is
# the keys themselves).
_ROUTER = "serving_models.routing.router"
_ROUTE = ({"function": f"{_ROUTER}:_route_softmax"}, {"function": f"{_ROUTER}:_route_sigmoid"})
STAGE_MAP = {
    "scores": [{"function": f"{_ROUTER}:softmax_scores"}, {"function": f"{_ROUTER}:sigmoid_fp32"}],
    "keys": [
        {"function": f"{_ROUTER}:_group_keep_mask", "input": True},
        {"function": f"{_ROUTER}:rank_candidates", "input": True},
    ],
    "group_mask": {"function": f"{_ROUTER}:_group_keep_mask"},
    "topk_ids": [{**route, "output": 1} for route in _ROUTE],
    "weights": [{**route, "output": 0} for route in _ROUTE],
    "masked_ids": {"function": f"{_ROUTER}:select_experts", "output": 1},
    "masked_weights": {"function": f"{_ROUTER}:select_experts", "output": 0},
}


class ServingRouter:
    """Graph-safe router of the serving target."""

    name = "serving"
    supports_capture = True
    stage_map = STAGE_MAP
    RoutingResult = routing.RoutingResult
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
        num_valid_rows: torch.Tensor | None = None,
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
        )

    def make_experts(self, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor) -> moe_experts.SwiGLUExperts:
        return moe_experts.SwiGLUExperts(gate_proj, up_proj, down_proj)

    def apply_experts(self, x: torch.Tensor, result: tuple[torch.Tensor, torch.Tensor], experts: object) -> torch.Tensor:
        weights, ids = result
        return moe_experts.apply_experts(x, weights, ids, experts)

    def remap(self, ids: torch.Tensor, replica_table: torch.Tensor, row_choice: torch.Tensor) -> torch.Tensor:
        return routing.remap_to_physical(ids, replica_table, row_choice)

    def expert_load(self, ids: torch.Tensor, num_valid_rows: torch.Tensor | None, num_physical: int) -> torch.Tensor:
        return routing.expert_load(ids, num_valid_rows, num_physical)

    def route_then_gather(
        self,
        local_hidden: torch.Tensor,
        local_logits: torch.Tensor,
        local_n_valid: torch.Tensor,
        k: int,
        *,
        capacity: int,
        group=None,
        **options,
    ) -> routing_distributed.GatheredRoutes:
        return routing_distributed.route_then_gather(
            local_hidden, local_logits, local_n_valid, k, capacity=capacity, group=group, **options
        )

    def gather_then_route(
        self,
        local_hidden: torch.Tensor,
        local_logits: torch.Tensor,
        local_n_valid: torch.Tensor,
        k: int,
        *,
        capacity: int,
        group=None,
        **options,
    ) -> routing_distributed.GatheredRoutes:
        return routing_distributed.gather_then_route(
            local_hidden, local_logits, local_n_valid, k, capacity=capacity, group=group, **options
        )


def make_router() -> ServingRouter:
    return ServingRouter()

"""Route before the rows move, or after: the two orders of MoE routing across ranks.

`route_then_gather` is the design of ROCm/ATOM#2725: each rank routes the rows it owns with its
own device-side real-row count (pad rows become -1 / 0 at the source), then the rows travel with
their ids and weights in one all-gather, padded to a fixed per-rank capacity. `gather_then_route`
is the older order: gather the raw logits, route every gathered row, and mask each rank's pad rows
afterwards from the gathered counts. With a batch-invariant router (docs/routing.md R8) the two are bitwise equal;
a router whose result depends on the batch, or a pad mask that misses a rank's tail, breaks it.

Every step is a device op (the counts are gathered, never read on the host), so both run under
graph capture on backends whose collectives capture. Padding to capacity is explicit: pad
logits are NaN and pad hidden rows zero, never uninitialised memory (ROCm/ATOM#1208, #1229).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from serving_models.routing import router as routing


@dataclass(frozen=True)
class GatheredRoutes:
    """All ranks' rows after the gather, rank-major, `capacity` rows per rank."""

    hidden: torch.Tensor  # [W * C, H]
    weights: torch.Tensor  # fp32 [W * C, k + S]
    ids: torch.Tensor  # int32 [W * C, k + S]
    counts: torch.Tensor  # int64 [W]: each rank's real rows, clamp(n_valid, 0, local rows)


def pad_rows_to(tensor: torch.Tensor, capacity: int, fill: float) -> torch.Tensor:
    """`tensor [T, ...]` padded with `fill` rows to `capacity` rows (a static shape for the gather)."""
    rows = tensor.shape[0]
    if rows > capacity:
        raise ValueError(f"routing_distributed: {rows} local rows exceed the capacity {capacity}")
    if rows == capacity:
        return tensor
    pad = torch.full((capacity - rows, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, pad], dim=0)


def all_gather_rows(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's equally shaped `tensor` along dim 0, in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _local_count(local_n_valid: torch.Tensor, local_rows: int) -> torch.Tensor:
    return routing.valid_row_count(local_n_valid, local_rows)


def route_then_gather(
    local_hidden: torch.Tensor,
    local_logits: torch.Tensor,
    local_n_valid: torch.Tensor,
    k: int,
    *,
    capacity: int,
    group: dist.ProcessGroup | None = None,
    **routing_kwargs: Any,
) -> GatheredRoutes:
    """Route this rank's rows with its own count, then gather rows with their ids and weights."""
    local_rows = local_logits.shape[0]
    routed = routing.select_experts(local_logits, k, num_valid_rows=local_n_valid, **routing_kwargs)
    return GatheredRoutes(
        hidden=all_gather_rows(pad_rows_to(local_hidden, capacity, 0.0), group),
        weights=all_gather_rows(pad_rows_to(routed.weights, capacity, 0.0), group),
        ids=all_gather_rows(pad_rows_to(routed.ids, capacity, -1), group),
        counts=all_gather_rows(_local_count(local_n_valid, local_rows), group),
    )


def gather_then_route(
    local_hidden: torch.Tensor,
    local_logits: torch.Tensor,
    local_n_valid: torch.Tensor,
    k: int,
    *,
    capacity: int,
    group: dist.ProcessGroup | None = None,
    **routing_kwargs: Any,
) -> GatheredRoutes:
    """Gather raw logits and counts, route every gathered row, then mask each rank's pad rows."""
    local_rows = local_logits.shape[0]
    counts = all_gather_rows(_local_count(local_n_valid, local_rows), group)
    logits = all_gather_rows(pad_rows_to(local_logits, capacity, float("nan")), group)
    routed = routing.select_experts(logits, k, num_valid_rows=None, **routing_kwargs)
    position = torch.arange(logits.shape[0], device=logits.device)
    row_is_real = (position % capacity) < counts[position // capacity]
    weights, ids = routing.mask_pad_rows(routed.weights, routed.ids, row_is_real)
    return GatheredRoutes(
        hidden=all_gather_rows(pad_rows_to(local_hidden, capacity, 0.0), group),
        weights=weights,
        ids=ids,
        counts=counts,
    )

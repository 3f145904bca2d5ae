"""Graph-safe MoE top-k router: softmax and grouped (sigmoid + correction bias) selection.

Written the way a serving engine writes its router: one vectorized pass over a padded batch of
`T` rows, no host reads, no data-dependent shapes, so the same code runs eager, under
`torch.compile(fullgraph=True)` and inside a captured graph. The number of real rows arrives as a
device tensor (`num_valid_rows`); rows at or past it get id -1 and weight 0 in every column, so a
replayed graph follows whatever count the runner wrote into that tensor before the replay
(docs/routing.md §4, ROCm/ATOM#2725).

Rules (docs/routing.md R1-R8): fp32 keys and weights; a candidate is a finite logit; candidates rank
by descending key with the lower expert id first on equal keys; slots past the row's candidate
count hold -1 / 0; the output is `[T, k + S]` int32 ids and fp32 weights, returned as
`RoutingResult(weights, ids)`. Every per-row computation is elementwise, an exact reduction
(max, integer count, top-k over distinct integers) or a sum in a fixed order, so a real row's
result is a bitwise function of that row's logits (R8), whatever the batch around it.

Three behaviours live in one small named function each, so a sensitivity check can replace
exactly one of them: `valid_row_count` (reads the count, on the device), `mask_pad_rows` (writes
-1 / 0 into pad rows), `tie_break_order_key` (equal keys: the lower id ranks first).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

SCORING_FUNCS = ("softmax", "sigmoid")
SHARED_WEIGHT_MODES = ("folded", "unfolded")

# Guards only a zero sum of selected sigmoid scores (docs/routing.md §3 step 5); rounded to fp32
# once so eager, compiled and reference arithmetic all add the same number.
RENORM_EPS = float(np.float32(1e-20))


class RoutingResult(NamedTuple):
    """The router's output. The order (weights, ids) is part of the contract (ROCm/ATOM f0ff38905)."""

    weights: torch.Tensor  # fp32 [T, k + S]
    ids: torch.Tensor  # int32 [T, k + S], -1 = no route


# --------------------------------------------------------------------------------------------
# The three named behaviours a sensitivity mutant replaces.
# --------------------------------------------------------------------------------------------


def valid_row_count(num_valid_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The pass's real-row count as a device tensor of shape [1]: `clamp(n_valid, 0, T)`.

    Read on the device (never `int(...)` / `.item()`): a captured graph then follows the value the
    runner wrote into the same tensor before each replay. The count may be -1 or exceed T.
    """
    return num_valid_rows.reshape(-1)[:1].to(torch.int64).clamp(0, num_rows)


def mask_pad_rows(weights: torch.Tensor, ids: torch.Tensor, row_is_real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad rows (`row_is_real[r]` False) get id -1 and weight 0 in every column (R6)."""
    real = row_is_real.reshape(-1, 1)
    return (
        torch.where(real, weights, torch.zeros_like(weights)),
        torch.where(real, ids, torch.full_like(ids, -1)),
    )


def tie_break_order_key(keys: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is R3's order: larger fp32 key first, equal keys lower id first.

    The fp32 bits are mapped to an int32 that orders like the float (negative floats have their
    magnitude bits flipped), then widened and shifted up 32 bits; the low 32 bits hold `n - 1 - id`.
    The map is strictly monotone on fp32 keys, so distinct keys keep their order and only equal
    keys are decided by the id; every composite is distinct, so `topk` has one answer on any
    backend (its own tie order is unspecified). -0.0 is first folded onto +0.0, which it equals.
    Keys must be finite or -inf (non-candidates are -inf, never NaN).
    """
    n = keys.shape[-1]
    canonical = torch.where(keys == 0, torch.zeros_like(keys), keys)
    bits = canonical.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    lower_id_bonus = (n - 1) - torch.arange(n, device=keys.device, dtype=torch.int64)
    return ordered * (1 << 32) + lower_id_bonus


# --------------------------------------------------------------------------------------------
# Building blocks (each per row, batch-invariant).
# --------------------------------------------------------------------------------------------


def sigmoid_fp32(x: torch.Tensor) -> torch.Tensor:
    """σ(x) = 1 / (1 + exp(-x)), elementwise.

    Not `torch.sigmoid`: on the CPU build the lane pins, its vectorized body and scalar tail round
    differently (measured: 725 of 20000 values differ by an ulp between a long tensor and one
    element at a time), so equal logits at different positions of a row get unequal scores, which
    breaks ties (R3) and batch invariance (R8). `exp` gives the same bits in both paths.
    """
    return 1.0 / (1.0 + torch.exp(-x))


def rank_candidates(keys: torch.Tensor, num_candidates: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of `keys` per row in R3 order; slots at or past the row's candidate count are -1.

    Returns `(ids int32 [T, k], slot_is_valid bool [T, k], index int64 [T, k])`; `index` is a safe
    in-range gather index for every slot (meaningless where the slot is invalid).
    """
    index = torch.topk(tie_break_order_key(keys), k, dim=-1, sorted=True).indices
    slot = torch.arange(k, device=keys.device, dtype=torch.int64)
    slot_is_valid = slot.unsqueeze(0) < num_candidates.unsqueeze(-1)
    ids = torch.where(slot_is_valid, index, torch.full_like(index, -1)).to(torch.int32)
    return ids, slot_is_valid, index


def slot_order_sum(values: torch.Tensor) -> torch.Tensor:
    """Row sums over the last dim added left to right in fp32 (slot order, as the reference does)."""
    total = values[..., 0]
    for j in range(1, values.shape[-1]):
        total = total + values[..., j]
    return total


def pairwise_row_sum(values: torch.Tensor) -> torch.Tensor:
    """Row sums over the last dim by a fixed pairwise tree (zero-padded to a power of two).

    Every level is an elementwise add, so the rounding of a row's sum cannot depend on the batch
    size or on a reduction kernel's blocking (R8).
    """
    width = values.shape[-1]
    size = 1 << max(width - 1, 0).bit_length()
    if size != width:
        values = torch.nn.functional.pad(values, (0, size - width))
    while values.shape[-1] > 1:
        half = values.shape[-1] // 2
        values = values[..., :half] + values[..., half:]
    return values[..., 0]


def _fp32_scalar(value: float) -> float:
    """`value` rounded to fp32, so scaling an fp32 tensor by it is one fp32 rounding on any backend."""
    return float(np.float32(value))


# --------------------------------------------------------------------------------------------
# Selection.
# --------------------------------------------------------------------------------------------


def _group_keep_mask(keys: torch.Tensor, num_expert_group: int, topk_group: int, sum_top2: bool) -> torch.Tensor:
    """bool [T, E]: experts inside each row's `topk_group` best groups (docs/routing.md §3 steps 2-3)."""
    rows, num_experts = keys.shape
    grouped = keys.reshape(rows, num_expert_group, num_experts // num_expert_group)
    if sum_top2:  # groups of at least two experts: `_check_config` refuses groups of one with a bias
        top2 = torch.topk(grouped, 2, dim=-1, sorted=True).values
        group_score = top2[..., 0] + top2[..., 1]
    else:
        group_score = grouped.amax(dim=-1)
    kept = torch.topk(tie_break_order_key(group_score), topk_group, dim=-1, sorted=True).indices
    keep = torch.zeros(rows, num_expert_group, dtype=torch.bool, device=keys.device)
    keep = keep.scatter(1, kept, True)
    # Broadcast each group's flag over its experts (expand, not repeat_interleave: the latter
    # builds a repeats tensor and sums it, a host sync on CUDA).
    return keep.unsqueeze(-1).expand(rows, num_expert_group, num_experts // num_expert_group).reshape(rows, num_experts)


def softmax_scores(x: torch.Tensor) -> torch.Tensor:
    """p = exp(x - max over the row's candidates), 0 off the candidates (docs/routing.md §2): the
    softmax numerators the weights divide by the selected or the full sum."""
    is_candidate = torch.isfinite(x)
    row_max = torch.where(is_candidate, x, torch.full_like(x, float("-inf"))).amax(dim=-1, keepdim=True)
    return torch.where(is_candidate, torch.exp(x - row_max), torch.zeros_like(x))


def _route_softmax(x: torch.Tensor, k: int, renormalize: bool, keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/routing.md §2: key = fp32 logit; p = exp(x - max); renormalize over the selected or the full row."""
    is_candidate = torch.isfinite(x)
    neg_inf = torch.full_like(x, float("-inf"))
    p = softmax_scores(x)

    if keep is not None:
        is_candidate = is_candidate & keep
    keys = torch.where(is_candidate, x, neg_inf)
    ids, slot_is_valid, index = rank_candidates(keys, is_candidate.sum(dim=-1), k)

    picked = torch.where(slot_is_valid, torch.gather(p, 1, index), torch.zeros_like(index, dtype=p.dtype))
    denominator = slot_order_sum(picked) if renormalize else pairwise_row_sum(p)
    weights = picked / denominator.unsqueeze(-1)
    return torch.where(slot_is_valid, weights, torch.zeros_like(weights)), ids


def _route_sigmoid(
    x: torch.Tensor,
    k: int,
    renormalize: bool,
    bias: torch.Tensor | None,
    num_expert_group: int | None,
    topk_group: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/routing.md §3: key = σ(x) + bias; groups masked with -inf; weights from the unbiased σ(x)."""
    is_candidate = torch.isfinite(x)
    scores = sigmoid_fp32(x)
    biased = scores if bias is None else scores + bias
    keys = torch.where(is_candidate, biased, torch.full_like(x, float("-inf")))
    if num_expert_group is not None:
        # With a bias the group score is the sum of its two best keys, without one its best key.
        keep = _group_keep_mask(keys, num_expert_group, topk_group, sum_top2=bias is not None)
        is_candidate = is_candidate & keep
        keys = torch.where(keep, keys, torch.full_like(keys, float("-inf")))  # never 0.0 (docs/routing.md §3 step 3)
    ids, slot_is_valid, index = rank_candidates(keys, is_candidate.sum(dim=-1), k)

    picked = torch.where(slot_is_valid, torch.gather(scores, 1, index), torch.zeros_like(index, dtype=scores.dtype))
    if renormalize:
        picked = picked / (slot_order_sum(picked) + RENORM_EPS).unsqueeze(-1)
    return torch.where(slot_is_valid, picked, torch.zeros_like(picked)), ids


def _check_config(
    logits: torch.Tensor,
    k: int,
    scoring: str,
    num_expert_group: int | None,
    topk_group: int | None,
    correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
    num_shared_experts: int,
    shared_weight_mode: str,
    num_valid_rows: torch.Tensor | None,
) -> None:
    """Static (metadata-only) argument checks: no tensor values are read."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"select_experts: logits must be a float [T, E] tensor, got {tuple(logits.shape)} {logits.dtype}")
    num_experts = logits.shape[1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"select_experts: k must lie in [1, E={num_experts}], got k={k}")
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"select_experts: scoring must be one of {SCORING_FUNCS}, got {scoring!r}")
    if shared_weight_mode not in SHARED_WEIGHT_MODES:
        raise ValueError(f"select_experts: shared_weight_mode must be one of {SHARED_WEIGHT_MODES}, got {shared_weight_mode!r}")
    if num_shared_experts < 0:
        raise ValueError(f"select_experts: num_shared_experts must be >= 0, got {num_shared_experts}")
    if not 0 < routed_scaling_factor < math.inf:  # also false for NaN; plain comparisons trace under Dynamo
        raise ValueError(f"select_experts: routed_scaling_factor must be finite and > 0, got {routed_scaling_factor}")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError(
            "select_experts: num_expert_group and topk_group go together, got "
            f"num_expert_group={num_expert_group}, topk_group={topk_group}"
        )
    if num_expert_group is not None:
        if num_expert_group < 1 or num_experts % num_expert_group:
            raise ValueError(f"select_experts: E={num_experts} must split into num_expert_group={num_expert_group} equal groups")
        if not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"select_experts: topk_group must lie in [1, {num_expert_group}], got {topk_group}")
    if correction_bias is not None:
        if scoring != "sigmoid":
            raise ValueError("select_experts: correction_bias is defined for scoring='sigmoid' only (docs/routing.md §3)")
        if tuple(correction_bias.shape) != (num_experts,):
            raise ValueError(
                f"select_experts: correction_bias must have shape ({num_experts},), got {tuple(correction_bias.shape)}"
            )
        if correction_bias.device != logits.device:
            raise ValueError(f"select_experts: correction_bias is on {correction_bias.device}, logits on {logits.device}")
        if num_expert_group is not None and num_expert_group == num_experts:
            # Groups of one expert: the sum-of-two group score does not exist, every group would be
            # -inf and the experts chosen by group id (docs/routing.md §3). Refused, as SGLang and HF do.
            raise ValueError(
                f"select_experts: num_expert_group={num_expert_group} splits E={num_experts} into groups of one expert; "
                "with a correction_bias a group scores the sum of its two best keys, which a group of one does not have, "
                "so every group would score -inf and the experts be chosen by group id (docs/routing.md §3): route "
                "without groups (num_expert_group=None) or with groups of at least two experts"
            )
    if num_valid_rows is not None:
        if not isinstance(num_valid_rows, torch.Tensor):
            raise TypeError(
                "select_experts: num_valid_rows must be a device tensor (a Python number would be baked "
                f"into a captured graph), got {type(num_valid_rows).__name__}"
            )
        if num_valid_rows.dtype.is_floating_point or num_valid_rows.dtype == torch.bool or num_valid_rows.numel() < 1:
            raise ValueError(
                f"select_experts: num_valid_rows must be an integer tensor with at least one element, "
                f"got {num_valid_rows.dtype} of shape {tuple(num_valid_rows.shape)}"
            )
        if num_valid_rows.device != logits.device:
            raise ValueError(f"select_experts: num_valid_rows is on {num_valid_rows.device}, logits on {logits.device}")


def append_shared_experts(
    result: RoutingResult,
    num_shared_experts: int,
    first_shared_id: int,
    shared_weight: float,
) -> RoutingResult:
    """Append `S` fused shared-expert columns: ids `first_shared_id + i`, weight `shared_weight`.

    Pad rows are not special-cased here: call `mask_pad_rows` afterwards (R6 covers shared columns).
    """
    if num_shared_experts == 0:
        return result
    rows = result.ids.shape[0]
    device = result.ids.device
    shared_ids = first_shared_id + torch.arange(num_shared_experts, device=device, dtype=torch.int32)
    shared_ids = shared_ids.unsqueeze(0).expand(rows, num_shared_experts)
    shared_weights = torch.full((rows, num_shared_experts), _fp32_scalar(shared_weight), dtype=torch.float32, device=device)
    return RoutingResult(torch.cat([result.weights, shared_weights], dim=1), torch.cat([result.ids, shared_ids], dim=1))


def row_is_real(num_valid_rows: torch.Tensor | None, num_rows: int, device: torch.device) -> torch.Tensor | None:
    """bool [T]: row r is real iff r < clamp(n_valid, 0, T); None when every row is real."""
    if num_valid_rows is None:
        return None
    count = valid_row_count(num_valid_rows, num_rows)
    return torch.arange(num_rows, device=device, dtype=torch.int64) < count


def select_experts(
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
) -> RoutingResult:
    """Route `logits [T, E]` to `k` experts per row (+ `S` shared columns); graph-safe.

    `shared_weight_mode="folded"`: routed weights include `routed_scaling_factor`, shared weight
    1.0. `"unfolded"`: the caller multiplies the combined output by the factor, so routed weights
    exclude it and the shared weight is `1 / routed_scaling_factor` (docs/routing.md §5).
    `num_valid_rows`: int device tensor, first element = real rows; None = every row is real.
    """
    _check_config(
        logits,
        k,
        scoring,
        num_expert_group,
        topk_group,
        correction_bias,
        routed_scaling_factor,
        num_shared_experts,
        shared_weight_mode,
        num_valid_rows,
    )
    rows, num_experts = logits.shape
    x = logits.to(torch.float32)

    if scoring == "softmax":
        keep = None
        if num_expert_group is not None:
            keys = torch.where(torch.isfinite(x), x, torch.full_like(x, float("-inf")))
            keep = _group_keep_mask(keys, num_expert_group, topk_group, sum_top2=False)
        weights, ids = _route_softmax(x, k, renormalize, keep)
    else:
        bias = None if correction_bias is None else correction_bias.to(torch.float32)  # never cast down (R1)
        weights, ids = _route_sigmoid(x, k, renormalize, bias, num_expert_group, topk_group)

    rsf = _fp32_scalar(routed_scaling_factor)
    if shared_weight_mode == "folded" and rsf != 1.0:
        weights = weights * rsf
    shared_weight = 1.0 if shared_weight_mode == "folded" else 1.0 / rsf
    result = append_shared_experts(RoutingResult(weights, ids), num_shared_experts, num_experts, shared_weight)

    real = row_is_real(num_valid_rows, rows, logits.device)
    if real is not None:
        result = RoutingResult(*mask_pad_rows(result.weights, result.ids, real))
    return result


# --------------------------------------------------------------------------------------------
# Consumers of the ids: EPLB remap and the per-expert load counter (docs/routing.md §6).
# --------------------------------------------------------------------------------------------


def remap_to_physical(ids: torch.Tensor, replica_table: torch.Tensor, row_choice: torch.Tensor) -> torch.Tensor:
    """Logical → physical expert ids; -1 and ids outside `[0, E)` pass through unchanged.

    `replica_table [E, R]` int: the physical ids of each logical expert's replicas, a prefix of
    valid entries followed by -1 padding when experts have fewer than R replicas (at least one
    each). `row_choice [T]` int: the row's replica choice; it picks replica
    `row_choice[r] mod replicas(e)`, so it depends on the row and never on the logical expert.
    """
    if ids.dim() != 2 or replica_table.dim() != 2 or row_choice.shape != ids.shape[:1]:
        raise ValueError(
            f"remap: ids must be [T, K], replica_table [E, R], row_choice [T]; got {tuple(ids.shape)}, "
            f"{tuple(replica_table.shape)}, {tuple(row_choice.shape)}"
        )
    num_logical = replica_table.shape[0]
    table = replica_table.to(device=ids.device, dtype=torch.int64)
    replicas = (table >= 0).sum(dim=1).clamp_min(1)
    in_range = (ids >= 0) & (ids < num_logical)  # the guard before any // or % on an id (docs/routing.md §4)
    safe = torch.where(in_range, ids, torch.zeros_like(ids)).to(torch.int64)
    slot = torch.remainder(row_choice.to(torch.int64).unsqueeze(1), replicas[safe])
    physical = table[safe, slot].to(ids.dtype)
    return torch.where(in_range, physical, ids)


def expert_load(ids: torch.Tensor, num_valid_rows: torch.Tensor | None, num_physical: int) -> torch.Tensor:
    """int64 [num_physical]: routes per expert over ids in `[0, num_physical)` on real rows only.

    Capture-safe: a masked scatter-add of ones, no bincount, no host read.
    """
    rows = ids.shape[0]
    counted = (ids >= 0) & (ids < num_physical)
    real = row_is_real(num_valid_rows, rows, ids.device)
    if real is not None:
        counted = counted & real.unsqueeze(1)
    safe = torch.where(counted, ids, torch.zeros_like(ids)).to(torch.int64).reshape(-1)
    load = torch.zeros(num_physical, dtype=torch.int64, device=ids.device)
    return load.scatter_add(0, safe, counted.to(torch.int64).reshape(-1))

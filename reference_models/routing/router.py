"""Reference MoE top-k router, written plainly: one row at a time, decisions on the host.

This is the truth the serving router is compared with (docs/routing.md §9). Scores are computed
elementwise on the logits' device (the same elementwise fp32 formulas a router runs, so both sides
see the same key bits); every decision after that is a per-row Python loop: candidates are the
finite logits, the ranking is a stable sort by descending key with the lower expert id first,
groups are ranked the same way, sums run in a fixed written order in fp32 (or fp64 for the
golden), pad rows are skipped by reading the valid-row count on the host.

Rules: docs/routing.md R1-R8 and §2-§6.
- Softmax (docs/routing.md §2): key = fp32 logit; `p = exp(x - max)` over candidates; renormalize
  divides by the selected sum (slot order), otherwise by the full candidate sum (ascending id).
- Grouped sigmoid (docs/routing.md §3): key = σ(x) + bias; group score = sum of its two best keys
  with a bias (-inf below two candidates), its best key without; the `topk_group` best groups stay
  (lower group id on ties), every other expert is -inf (never 0.0); weights are the unbiased σ(x),
  renormalized with `+1e-20`; then times `routed_scaling_factor`.
- Softmax-scored grouped routing uses the group maximum of the logits and the weights of
  docs/routing.md §2.

`golden=True` computes the weights with the same formulas in fp64 for the same (fp32-selected)
experts, so a target's weight error can be judged against the reference's own fp32 error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

SCORING_FUNCS = ("softmax", "sigmoid")
SHARED_WEIGHT_MODES = ("folded", "unfolded")
RENORM_EPS = 1e-20  # guards a zero sum of selected sigmoid scores only (docs/routing.md §3 step 5)
NO_EXPERT = -1


class RoutingResult(NamedTuple):
    """Router output; the (weights, ids) order is part of the contract (ROCm/ATOM f0ff38905)."""

    weights: torch.Tensor  # fp32 [T, k + S] (fp64 with golden=True)
    ids: torch.Tensor  # int32 [T, k + S], -1 = no route


@dataclass(frozen=True)
class RoutingConfig:
    """The static routing configuration of one MoE layer."""

    k: int
    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    shared_weight_mode: str = "folded"

    def validate(self, num_experts: int, has_bias: bool) -> None:
        if not 1 <= self.k <= num_experts:
            raise ValueError(f"reference router: k must lie in [1, E={num_experts}], got k={self.k}")
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"reference router: scoring must be one of {SCORING_FUNCS}, got {self.scoring!r}")
        if self.shared_weight_mode not in SHARED_WEIGHT_MODES:
            raise ValueError(
                f"reference router: shared_weight_mode must be one of {SHARED_WEIGHT_MODES}, got {self.shared_weight_mode!r}"
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"reference router: num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if not (self.routed_scaling_factor > 0 and math.isfinite(self.routed_scaling_factor)):
            raise ValueError(f"reference router: routed_scaling_factor must be finite and > 0, got {self.routed_scaling_factor}")
        if (self.num_expert_group is None) != (self.topk_group is None):
            raise ValueError(
                "reference router: num_expert_group and topk_group go together, got "
                f"num_expert_group={self.num_expert_group}, topk_group={self.topk_group}"
            )
        if self.num_expert_group is not None:
            if self.num_expert_group < 1 or num_experts % self.num_expert_group:
                raise ValueError(
                    f"reference router: E={num_experts} must split into num_expert_group={self.num_expert_group} equal groups"
                )
            if not 1 <= self.topk_group <= self.num_expert_group:
                raise ValueError(f"reference router: topk_group must lie in [1, {self.num_expert_group}], got {self.topk_group}")
        if has_bias and self.scoring != "sigmoid":
            raise ValueError("reference router: correction_bias is defined for scoring='sigmoid' only (docs/routing.md §3)")
        if has_bias and self.num_expert_group is not None and num_experts == self.num_expert_group:
            raise ValueError(groups_of_one_message("reference router", num_experts, self.num_expert_group))


def groups_of_one_message(who: str, num_experts: int, num_expert_group: int) -> str:
    """Why grouped routing with groups of one expert and a correction bias is refused (docs/routing.md §3)."""
    return (
        f"{who}: num_expert_group={num_expert_group} splits E={num_experts} into groups of one expert; with a "
        "correction_bias a group scores the sum of its two best keys, which a group of one does not have, so every "
        "group would score -inf and the experts be chosen by group id (docs/routing.md §3): route without groups "
        "(num_expert_group=None) or with groups of at least two experts"
    )


# --------------------------------------------------------------------------------------------
# Small helpers.
# --------------------------------------------------------------------------------------------


def count_real_rows(num_valid_rows: torch.Tensor | int | None, num_rows: int) -> int:
    """`clamp(n_valid, 0, T)`, read on the host (the reference may); None means every row."""
    if num_valid_rows is None:
        return num_rows
    if isinstance(num_valid_rows, torch.Tensor):
        if num_valid_rows.dtype.is_floating_point or num_valid_rows.numel() < 1:
            raise ValueError(
                f"reference router: num_valid_rows must be an integer tensor with at least one element, "
                f"got {num_valid_rows.dtype} of shape {tuple(num_valid_rows.shape)}"
            )
        num_valid_rows = int(num_valid_rows.reshape(-1)[0])
    return min(max(int(num_valid_rows), 0), num_rows)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """σ(x) = 1 / (1 + exp(-x)) elementwise (the serving router uses the same formula: on CPU,
    `torch.sigmoid` rounds its vectorized body and scalar tail differently, so the bits of σ of one
    value would depend on where it sits in the tensor)."""
    return 1.0 / (1.0 + torch.exp(-x))


def rank_by_key(keys: list[float], members: list[int]) -> list[int]:
    """`members` sorted by descending key; equal keys: the lower id first (R3)."""
    return sorted(members, key=lambda i: (-keys[i], i))


def dtype_spacing(magnitude: float, dtype: torch.dtype) -> float:
    """The distance between adjacent `dtype` values at `magnitude` (one ULP there)."""
    info = torch.finfo(dtype)
    magnitude = abs(magnitude)
    if not math.isfinite(magnitude):
        return math.inf
    if magnitude < info.smallest_normal:
        return info.smallest_normal * info.eps  # subnormal spacing
    _, exponent = math.frexp(magnitude)  # magnitude = m * 2**exponent, m in [0.5, 1)
    return info.eps * 2.0 ** (exponent - 1)


# --------------------------------------------------------------------------------------------
# Per-row selection.
# --------------------------------------------------------------------------------------------


@dataclass
class RowScores:
    """One row's fp32 selection keys (candidates finite, others -inf) and its candidate flags."""

    keys: list[float]
    is_candidate: list[bool]


def kept_experts(row: RowScores, config: RoutingConfig, has_bias: bool) -> tuple[list[int], list[float]]:
    """Experts left after group-limited selection (all candidates without groups), and the group
    scores (empty without groups)."""
    candidates = [e for e in range(len(row.keys)) if row.is_candidate[e]]
    if config.num_expert_group is None:
        return candidates, []
    keep, group_scores = group_keep(row, config, has_bias)
    # Experts of dropped groups leave the candidate set: their key is -inf, never 0.0.
    return [e for e in candidates if keep[e]], group_scores


def group_keep(row: RowScores, config: RoutingConfig, has_bias: bool) -> tuple[list[bool], list[float]]:
    """Grouped rows only: bool [E], the experts inside the row's `topk_group` best groups, and the
    group scores (a function of its own so that a localisation reads the row's group mask)."""
    num_experts = len(row.keys)
    group_size = num_experts // config.num_expert_group
    group_scores: list[float] = []
    for g in range(config.num_expert_group):
        members = [e for e in range(g * group_size, (g + 1) * group_size) if row.is_candidate[e]]
        best = sorted((row.keys[e] for e in members), reverse=True)
        if has_bias:
            # Sum of the two best biased scores, in fp32; fewer than two candidates: -inf.
            score = float(np.float32(best[0]) + np.float32(best[1])) if len(best) >= 2 else -math.inf
        else:
            score = best[0] if best else -math.inf
        group_scores.append(score)
    keep = [False] * num_experts
    for g in rank_by_key(group_scores, list(range(config.num_expert_group)))[: config.topk_group]:
        keep[g * group_size : (g + 1) * group_size] = [True] * group_size
    return keep, group_scores


def select_row(row: RowScores, config: RoutingConfig, has_bias: bool) -> list[int]:
    """The row's selected experts in slot order; fewer than k when it has fewer candidates."""
    eligible, _ = kept_experts(row, config, has_bias)
    return rank_by_key(row.keys, eligible)[: config.k]


def _softmax_weights(selected: list[int], p: np.ndarray, is_candidate: list[bool], renormalize: bool, dtype: type) -> list:
    """docs/routing.md §2: weights of the selected experts from `p = exp(x - max)`: over the selected sum in slot
    order, or over every candidate in ascending expert id."""
    candidates = [e for e in range(len(p)) if is_candidate[e]]
    total = dtype(0)
    for e in selected if renormalize else candidates:
        total = dtype(total + dtype(p[e]))
    return [dtype(dtype(p[e]) / total) for e in selected]


def _sigmoid_weights(selected: list[int], scores: np.ndarray, renormalize: bool, dtype: type) -> list:
    """docs/routing.md §3: weights are the unbiased σ(x) of the selected experts, renormalized with +1e-20."""
    weights = [dtype(scores[e]) for e in selected]
    if renormalize:
        total = dtype(0)
        for w in weights:
            total = dtype(total + w)
        total = dtype(total + dtype(RENORM_EPS))
        weights = [dtype(w / total) for w in weights]
    return weights


def route_row(
    row: RowScores, scores: np.ndarray, config: RoutingConfig, has_bias: bool, dtype: type
) -> tuple[np.ndarray, np.ndarray]:
    """One row's routed slots: int32 [k] ids in slot order (-1 past its candidates) and [k] weights
    in `dtype` after renormalisation, before the scaling factor (0 on -1 slots)."""
    selected = select_row(row, config, has_bias)
    ids = np.full(config.k, NO_EXPERT, dtype=np.int32)
    weights = np.zeros(config.k, dtype=dtype)
    if selected:
        if config.scoring == "softmax":
            weights[: len(selected)] = _softmax_weights(selected, scores, row.is_candidate, config.renormalize, dtype)
        else:
            weights[: len(selected)] = _sigmoid_weights(selected, scores, config.renormalize, dtype)
        ids[: len(selected)] = selected
    return ids, weights


def weight_scores(logits: torch.Tensor, candidates: torch.Tensor, scoring: str, golden: bool) -> np.ndarray:
    """The scoring function's output for every row in the weight dtype (fp64 for the golden):
    softmax `p = exp(x - max over the row's candidates)` (0 off the candidates, which are never
    read), sigmoid σ(x). `candidates`: the finite fp32 logits."""
    x_w = logits.to(torch.float64 if golden else torch.float32)
    if scoring == "softmax":
        row_max = torch.where(candidates, x_w, torch.full_like(x_w, -math.inf)).amax(dim=1, keepdim=True)
        return torch.where(candidates, torch.exp(x_w - row_max), torch.zeros_like(x_w)).cpu().numpy()
    return sigmoid(x_w).cpu().numpy()


def _row_keys(x32: torch.Tensor, bias: torch.Tensor | None, scoring: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fp32 keys for every row (-inf for non-candidates), candidate flags, and σ(x) scores."""
    is_candidate = torch.isfinite(x32)
    if scoring == "softmax":
        scores = x32
        keys = x32
    else:
        scores = sigmoid(x32)
        keys = scores if bias is None else scores + bias
    keys = torch.where(is_candidate, keys, torch.full_like(keys, -math.inf))
    return keys.cpu().numpy(), is_candidate.cpu().numpy(), scores.cpu().numpy()


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
    num_valid_rows: torch.Tensor | int | None = None,
    golden: bool = False,
) -> RoutingResult:
    """Route `logits [T, E]`; see the module docstring for the rules.

    `shared_weight_mode="folded"`: routed weights include `routed_scaling_factor`, shared columns
    weigh 1.0; `"unfolded"`: routed weights exclude it (the caller scales the combined output) and
    shared columns weigh `1 / routed_scaling_factor`. `golden=True`: fp64 weights, same experts.
    """
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"reference router: logits must be a float [T, E] tensor, got {tuple(logits.shape)} {logits.dtype}")
    num_rows, num_experts = logits.shape
    config = RoutingConfig(
        k,
        scoring,
        renormalize,
        num_expert_group,
        topk_group,
        routed_scaling_factor,
        num_shared_experts,
        shared_weight_mode,
    )
    config.validate(num_experts, correction_bias is not None)
    if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(
            f"reference router: correction_bias must have shape ({num_experts},), got {tuple(correction_bias.shape)}"
        )

    weight_dtype = np.float64 if golden else np.float32
    x32 = logits.to(torch.float32)
    bias32 = None if correction_bias is None else correction_bias.to(device=logits.device, dtype=torch.float32)
    keys, is_candidate, _ = _row_keys(x32, bias32, scoring)
    # Weights use the same formulas in the weight dtype (fp64 for the golden).
    scores_w = weight_scores(logits, torch.isfinite(x32), scoring, golden)

    width = k + num_shared_experts
    # Filled row by row in numpy (an element write into a tensor costs microseconds), handed over at the end.
    ids = np.full((num_rows, width), NO_EXPERT, dtype=np.int32)
    weights = np.zeros((num_rows, width), dtype=weight_dtype)
    rsf = weight_dtype(routed_scaling_factor)
    folded = shared_weight_mode == "folded"
    shared_weight = weight_dtype(1.0) if folded else weight_dtype(weight_dtype(1.0) / rsf)

    for r in range(count_real_rows(num_valid_rows, num_rows)):
        row = RowScores(keys[r].tolist(), is_candidate[r].tolist())
        row_ids, row_weights = route_row(row, scores_w[r], config, correction_bias is not None, weight_dtype)
        ids[r, :k] = row_ids
        weights[r, :k] = row_weights * rsf if folded else row_weights  # -1 slots stay 0
        for i in range(num_shared_experts):
            ids[r, k + i] = num_experts + i
            weights[r, k + i] = float(shared_weight)
    return RoutingResult(torch.from_numpy(weights).to(logits.device), torch.from_numpy(ids).to(logits.device))


# --------------------------------------------------------------------------------------------
# Margins at the k / k+1 boundary, for the near-tie audit (docs/tolerances.md §3).
# --------------------------------------------------------------------------------------------


class RoutingMargins(NamedTuple):
    """Per-row margins of the routing decision (fp64 tensors [T]; inf where no decision exists).

    `kth_key` / `next_key`: the k-th and (k+1)-th keys in rank order among eligible experts
    (`next_key` -inf when the row has at most k of them); `margin = kth_key - next_key`;
    `margin_ulps_fp32` / `margin_ulps_input`: the margin in spacings of fp32 and of the logits'
    dtype at the larger magnitude of the two keys; `group_margin`: for grouped routing, the
    topk_group-th minus the next group score (inf without groups or with all groups kept).
    """

    kth_key: torch.Tensor
    next_key: torch.Tensor
    margin: torch.Tensor
    margin_ulps_fp32: torch.Tensor
    margin_ulps_input: torch.Tensor
    group_margin: torch.Tensor
    group_margin_ulps_fp32: torch.Tensor


def _boundary(
    values: list[float], order: list[int], n: int, input_dtype: torch.dtype
) -> tuple[float, float, float, float, float]:
    """(n-th value, (n+1)-th value, margin, margin in fp32 ULPs, margin in input-dtype ULPs)."""
    if len(order) < n:
        return math.nan, -math.inf, math.inf, math.inf, math.inf
    kth = values[order[n - 1]]
    nxt = values[order[n]] if len(order) > n else -math.inf
    if not math.isfinite(nxt) or not math.isfinite(kth):
        return kth, nxt, math.inf, math.inf, math.inf
    margin = kth - nxt  # both fp32 values: exact in fp64
    magnitude = max(abs(kth), abs(nxt))
    return kth, nxt, margin, margin / dtype_spacing(magnitude, torch.float32), margin / dtype_spacing(magnitude, input_dtype)


def routing_margins(
    logits: torch.Tensor,
    k: int,
    *,
    scoring: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
) -> RoutingMargins:
    """k-th vs (k+1)-th selection-key margin of every row (and the group-selection margin).

    A target whose expert set differs from the reference's on a row with a margin within a few
    ULPs of the compared dtype is a `tie_flip`, otherwise a `fail` (docs/tolerances.md §3).
    """
    num_rows, num_experts = logits.shape
    config = RoutingConfig(k, scoring, True, num_expert_group, topk_group)
    config.validate(num_experts, correction_bias is not None)
    bias32 = None if correction_bias is None else correction_bias.to(device=logits.device, dtype=torch.float32)
    keys, is_candidate, _ = _row_keys(logits.to(torch.float32), bias32, scoring)
    has_bias = correction_bias is not None
    columns = [[] for _ in range(7)]
    for r in range(num_rows):
        row = RowScores(keys[r].tolist(), is_candidate[r].tolist())
        eligible, group_scores = kept_experts(row, config, has_bias)
        kth, nxt, margin, ulps32, ulps_in = _boundary(row.keys, rank_by_key(row.keys, eligible), k, logits.dtype)
        group_margin, group_ulps = math.inf, math.inf
        if group_scores and topk_group < num_expert_group:
            group_order = rank_by_key(group_scores, list(range(num_expert_group)))
            _, _, group_margin, group_ulps, _ = _boundary(group_scores, group_order, topk_group, logits.dtype)
        for column, value in zip(columns, (kth, nxt, margin, ulps32, ulps_in, group_margin, group_ulps)):
            column.append(value)
    return RoutingMargins(*(torch.tensor(c, dtype=torch.float64) for c in columns))


# --------------------------------------------------------------------------------------------
# Consumers of the ids (docs/routing.md §4-§6), plainly.
# --------------------------------------------------------------------------------------------


def remap(ids: torch.Tensor, replica_table: torch.Tensor, row_choice: torch.Tensor) -> torch.Tensor:
    """Logical → physical ids: `replica_table[e][row_choice[r] mod replicas(e)]` for `0 <= e < E`;
    -1 and every id outside `[0, E)` pass through unchanged.

    `replica_table [E, R]`: each logical expert's physical replicas, a prefix of valid entries then
    -1 padding; every expert needs at least one replica.
    """
    table = replica_table.cpu().tolist()
    for e, replicas in enumerate(table):
        valid = [p for p in replicas if p >= 0]
        if not valid or replicas[: len(valid)] != valid:
            raise ValueError(f"remap: replica_table row {e} must start with >= 1 physical id then only -1, got {replicas}")
    choice = row_choice.cpu().tolist()
    out = ids.cpu().clone()
    for r in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(out[r, j])
            if 0 <= e < len(table):
                replicas = [p for p in table[e] if p >= 0]
                out[r, j] = replicas[choice[r] % len(replicas)]
    return out.to(ids.device)


def expert_load(ids: torch.Tensor, num_valid_rows: torch.Tensor | int | None, num_physical: int) -> torch.Tensor:
    """int64 [num_physical]: how many routes of the real rows land on each expert; -1, ids out of
    range and pad rows are not counted."""
    load = [0] * num_physical
    host_ids = ids.cpu().tolist()
    for r in range(count_real_rows(num_valid_rows, ids.shape[0])):
        for e in host_ids[r]:
            if 0 <= e < num_physical:
                load[e] += 1
    return torch.tensor(load, dtype=torch.int64, device=ids.device)

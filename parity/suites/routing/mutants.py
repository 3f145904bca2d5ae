"""Known-bad routers for the `routing` suite (the sensitivity catalogue, routing family).

Each factory takes no argument, applies one run-time change to `serving_models.routing.router` by
monkeypatching one of its named behaviours, and returns the serving target: run the suite with
`--target parity.suites.routing.mutants:<factory>`. The patch lives in the process that calls the factory
(the pytest process, and each spawned rank of the rank- cases, which loads the target again from
the same spec); shipped code is never edited. `tests/suites/test_suites_routing.py` shows each one turns
the suite red and the unpatched target keeps it green.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from parity.suites.sensitivity.catalogue import external
from serving_models.routing import router as routing
from serving_models.target import ServingTarget, make_target

_ORIGINALS: dict[str, Callable[..., Any]] = {}


def _patch(name: str, replacement: Callable[..., Any]) -> None:
    """Replace `serving_models.routing.router.<name>` in this process (the first original is kept)."""
    _ORIGINALS.setdefault(name, getattr(routing, name))
    setattr(routing, name, replacement)


def serving_ignores_valid_rows() -> ServingTarget:
    """Router ignores `num_valid_rows`: pad rows are routed to real experts (vllm-project/vllm#50757,
    NVIDIA/Megatron-LM#5841); pad- and rank- must fail."""
    original = _ORIGINALS.get("select_experts", routing.select_experts)

    def select_experts(logits: torch.Tensor, k: int, *, num_valid_rows: torch.Tensor | None = None, **options: Any):
        return original(logits, k, **options)

    _patch("select_experts", select_experts)
    return make_target()


def serving_ties_to_highest_id() -> ServingTarget:
    """Equal keys rank the higher expert id first (AITER Triton routing's packed key,
    docs/routing.md §7); tie- and bf16 grid- must fail."""

    def highest_id_first(keys: torch.Tensor) -> torch.Tensor:
        canonical = torch.where(keys == 0, torch.zeros_like(keys), keys)
        bits = canonical.contiguous().view(torch.int32)
        ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
        return ordered * (1 << 32) + torch.arange(keys.shape[-1], device=keys.device, dtype=torch.int64)

    _patch("tie_break_order_key", highest_id_first)
    return make_target()


def serving_count_on_host() -> ServingTarget:
    """The valid-row count is read on the host (`int(n)`): eager is right, a capture fails or replays a stale count (ROCm/ATOM#2725 follow-up); replay- must fail."""

    def host_count(num_valid_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
        count = min(max(int(num_valid_rows.reshape(-1)[0]), 0), num_rows)
        return torch.full((1,), count, dtype=torch.int64, device=num_valid_rows.device)

    _patch("valid_row_count", host_count)
    return make_target()


def serving_group_score_max_with_bias() -> ServingTarget:
    """With a correction bias the group score is the max key, not the sum of the two best
    (DeepSeek-V2's grouping applied to V3-style biased routing); grid-grouped must fail."""
    original = _ORIGINALS.get("_group_keep_mask", routing._group_keep_mask)

    def group_keep_mask(keys: torch.Tensor, num_expert_group: int, topk_group: int, sum_top2: bool) -> torch.Tensor:
        return original(keys, num_expert_group, topk_group, False)

    _patch("_group_keep_mask", group_keep_mask)
    return make_target()


def serving_renormalize_ignored() -> ServingTarget:
    """Softmax routing ignores `renormalize=True`: the top-k weights keep the full row's
    denominator (Mixtral's norm_topk_prob read as always off); grid-softmax renorm must fail."""
    original = _ORIGINALS.get("_route_softmax", routing._route_softmax)

    def route_softmax(x: torch.Tensor, k: int, renormalize: bool, keep: torch.Tensor | None):
        return original(x, k, False, keep)

    _patch("_route_softmax", route_softmax)
    return make_target()


# ---------------------------------------------------------------------------------------------
# Catalogue entries: MoE routing (ROCm/ATOM#2725, ROCm/aiter#6916)
# ---------------------------------------------------------------------------------------------

external(
    "router-ignores-num-valid-rows",
    defect="the router ignores num_valid_rows: pad rows are dispatched to real experts (vllm-project/vllm#50757)",
    suite="routing",
    tests=("parity/suites/routing/test_edges.py", "-k", "pad-"),
    target="parity.suites.routing.mutants:serving_ignores_valid_rows",
    stage="masked_ids",
)
external(
    "router-ties-to-highest-id",
    defect="ties broken toward the highest expert id (AITER Triton routing's packed key)",
    suite="routing",
    # Expert ties: the tie rule also orders groups, and a tie between groups shows one stage earlier,
    # at group_mask (tests/suites/test_localise_routing.py), so those cases are left out here.
    tests=("parity/suites/routing/test_edges.py", "-k", "tie- and not between-groups"),
    target="parity.suites.routing.mutants:serving_ties_to_highest_id",
    stage="topk_ids",
)
external(
    "router-reads-count-on-host",
    defect="the router reads the valid-row count on the host: capture fails, or a replay keeps the captured count",
    suite="routing",
    tests=("parity/suites/routing/test_invariance.py", "-k", "replay"),
    target="parity.suites.routing.mutants:serving_count_on_host",
    stage="masked_ids",
    stage_note=(
        "eager is right: the count is read on the host only while a graph is recorded, which either refuses the "
        "host read (an error row, nothing replayed to tap) or bakes the recorded count into every replay; the "
        "routing stages are function taps, which record in eager runs only, so no stage shows it and the "
        "replay- rows (replay vs eager on the same inputs) name it"
    ),
)
external(
    "router-group-score-max-with-bias",
    defect="biased grouped top-k scores a group by its best key instead of the sum of its two best (DeepSeek-V2 grouping under V3-style biased routing): other groups kept",
    suite="routing",
    tests=("parity/suites/routing/test_grid.py", "-k", "grid-grouped and fp32 and T64"),
    target="parity.suites.routing.mutants:serving_group_score_max_with_bias",
    stage="group_mask",
)
external(
    "router-renormalize-ignored",
    defect="softmax routing ignores renormalize=True: the top-k weights keep the full row's denominator",
    suite="routing",
    tests=("parity/suites/routing/test_grid.py", "-k", "grid-softmax and fp32 and T64 and not norenorm"),
    target="parity.suites.routing.mutants:serving_renormalize_ignored",
    stage="weights",
)

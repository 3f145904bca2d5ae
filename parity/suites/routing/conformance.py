"""The routing family's conformance probe: every `RouterAdapter` member the routing suite calls, once
on a tiny batch, with the types and shapes docs/targets.md §7 gives (the result's form is the rule
the suite's contract row applies, `parity.target.router_result_problem`). `make_experts` and
`apply_experts` must be there (the Protocol) but no suite calls them, so neither does the probe:
check-target is never stricter than the suites."""

from __future__ import annotations

from typing import Any

import torch

from parity.conformance import Checks, shape_text
from parity.localise.validate import stage_map_report
from parity.target import RouterAdapter, router_result_problem


def _is(value: Any, dtype: torch.dtype, *shape: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == dtype and tuple(value.shape) == shape


def _pair(checks: Checks, call: str, result: Any, tokens: int, width: int) -> tuple[Any, Any] | None:
    """The (weights, ids) of a `select_experts` result, checked: its form, then dtypes and shapes."""
    form = router_result_problem(result)
    if not checks.expect(form is None, f"{call} must return the pair (weights, ids), plain or named; got {form}"):
        return None
    weights, ids = result
    ok = checks.expect(
        _is(weights, torch.float32, tokens, width),
        f"{call} must return weights fp32 [{tokens}, {width}] first, got {shape_text(weights)} {getattr(weights, 'dtype', '')}",
        f"{call} -> weights fp32 [{tokens}, {width}]",
    )
    ok &= checks.expect(
        _is(ids, torch.int32, tokens, width),
        f"{call} must return ids int32 [{tokens}, {width}] second, got {shape_text(ids)} {getattr(ids, 'dtype', '')}",
        f"{call} -> ids int32 [{tokens}, {width}] ({'named' if hasattr(result, '_fields') else 'plain'} pair)",
    )
    return (weights, ids) if ok else None


def probe(target: Any, device: str) -> list[str]:
    checks = Checks("router")
    router = checks.obtain("target.router()", target.router, "a router adapter, docs/targets.md §7")
    if router is None or not checks.require(router, RouterAdapter, "router adapter"):
        return checks.done()
    checks.what = f"router adapter {type(router).__name__}"
    checks.expect(isinstance(router.name, str) and router.name != "", f"name must be a non-empty str, got {router.name!r}")
    supports = getattr(router, "supports_capture", True)  # absent: the suite runs every mode (parity/suites/conftest.py)
    checks.expect(
        isinstance(supports, bool),
        f"supports_capture must be a bool (False: the graph modes of the routing suite skip), got {supports!r}",
        f"supports_capture {supports}",
    )
    problems, checked = stage_map_report(router, "routing", 0)  # where its stages are, for localising a failing case
    checks.problems += problems
    checks.checked += [checked] if checked else []
    tokens, experts, k = 4, 8, 2
    logits = torch.linspace(-1, 1, tokens * experts, device=device).reshape(tokens, experts)
    call = f"select_experts(logits [{tokens}, {experts}], k={k}, renormalize=True)"
    result = checks.attempt(call, lambda: router.select_experts(logits, k, renormalize=True))
    pair = _pair(checks, call, result, tokens, k)
    count = torch.tensor([tokens - 1], dtype=torch.int32, device=device)  # the suite's device-side count
    call = f"select_experts(..., num_valid_rows=tensor([{tokens - 1}]))"
    padded = checks.attempt(call, lambda: router.select_experts(logits, k, renormalize=True, num_valid_rows=count))
    _pair(checks, call, padded, tokens, k)
    # Every keyword the routing suite passes (docs/targets.md §7), at once: grouped sigmoid routing
    # with a correction bias, a scaling factor and one fused shared expert (docs/routing.md §3).
    grouped = dict(
        scoring="sigmoid",
        num_expert_group=4,
        topk_group=2,
        correction_bias=-torch.linspace(1, 2, experts, device=device),
        routed_scaling_factor=2.5,
        num_shared_experts=1,
        shared_weight_mode="folded",
    )
    call = "select_experts(..., scoring='sigmoid', num_expert_group=4, topk_group=2, correction_bias, num_shared_experts=1)"
    _pair(
        checks, call, checks.attempt(call, lambda: router.select_experts(logits, k, renormalize=True, **grouped)), tokens, k + 1
    )
    if pair is None:
        return checks.done()
    ids = pair[1]
    table = torch.arange(experts, dtype=torch.int32, device=device).reshape(experts, 1)
    choice = torch.zeros(tokens, dtype=torch.int32, device=device)
    physical = checks.attempt("remap(ids, replica_table [E, 1], row_choice [T])", lambda: router.remap(ids, table, choice))
    checks.expect(
        isinstance(physical, torch.Tensor) and not physical.is_floating_point() and tuple(physical.shape) == (tokens, k),
        f"remap(ids [{tokens}, {k}], ...) must return integer ids [{tokens}, {k}], got {shape_text(physical)}",
        f"remap -> [{tokens}, {k}]",
    )
    load = checks.attempt("expert_load(ids, num_valid_rows, E)", lambda: router.expert_load(ids, count, experts))
    checks.expect(
        isinstance(load, torch.Tensor) and not load.is_floating_point() and tuple(load.shape) == (experts,),
        f"expert_load(ids, num_valid_rows, {experts}) must return integer counts [{experts}] (int64), got {shape_text(load)}",
        f"expert_load -> [{experts}]",
    )
    return checks.done()

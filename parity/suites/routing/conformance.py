"""The routing family's conformance probe: every `RouterAdapter` member, and one routing of a tiny batch."""

from __future__ import annotations

from typing import Any

import torch

from parity.conformance import Checks, shape_text
from parity.target import RouterAdapter


def probe(target: Any, device: str) -> list[str]:
    checks = Checks("router")
    router = checks.attempt("target.router()", target.router)
    if router is None or not checks.require(router, RouterAdapter, "router adapter"):
        return checks.done()
    checks.what = f"router adapter {type(router).__name__}"
    tokens, experts, k = 4, 8, 2
    logits = torch.linspace(-1, 1, tokens * experts, device=device).reshape(tokens, experts)
    result = checks.attempt(
        f"select_experts(logits [{tokens}, {experts}], k={k}, renormalize=True)",
        lambda: router.select_experts(logits, k, renormalize=True),
    )
    if result is None:
        return checks.done()
    weights, ids = (
        (getattr(result, "weights", None), getattr(result, "ids", None)) if hasattr(result, "weights") else tuple(result)
    )
    checks.expect(
        isinstance(weights, torch.Tensor) and weights.dtype == torch.float32 and tuple(weights.shape) == (tokens, k),
        f"select_experts must return weights fp32 [{tokens}, {k}] first, got {shape_text(weights)} {getattr(weights, 'dtype', '')}",
        f"select_experts -> weights fp32 [{tokens}, {k}]",
    )
    checks.expect(
        isinstance(ids, torch.Tensor) and ids.dtype == torch.int32 and tuple(ids.shape) == (tokens, k),
        f"select_experts must return ids int32 [{tokens}, {k}] second, got {shape_text(ids)} {getattr(ids, 'dtype', '')}",
        f"select_experts -> ids int32 [{tokens}, {k}]",
    )
    return checks.done()

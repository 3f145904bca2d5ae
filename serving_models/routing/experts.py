"""Fused, graph-safe weighted sum of SwiGLU experts over routed slots.

One pass per slot over the whole padded batch: the slot's expert weights are gathered per row and
applied with a batched matmul, and a slot whose id is -1 (or outside `[0, N)`) is dropped with a
`where`, never multiplied by 0 (a pad row's hidden state may be NaN garbage, and 0 · NaN is NaN).
Static shapes, no host reads: it runs eager, compiled or replayed from a captured graph.
Cost: each slot gathers a [T, I, H] weight block, sized for parity shapes; an engine would run
grouped-GEMM kernels over the same ids with the same -1 rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SwiGLUExperts:
    """Stacked expert weights, routed experts first, then any fused shared experts.

    gate_proj, up_proj: [N, I, H]; down_proj: [N, H, I] (the nn.Linear layout: out x in).
    """

    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor

    def __post_init__(self) -> None:
        n, inter, hidden = self.gate_proj.shape
        if tuple(self.up_proj.shape) != (n, inter, hidden) or tuple(self.down_proj.shape) != (n, hidden, inter):
            raise ValueError(
                "SwiGLUExperts: expected gate_proj/up_proj [N, I, H] and down_proj [N, H, I], got "
                f"{tuple(self.gate_proj.shape)}, {tuple(self.up_proj.shape)}, {tuple(self.down_proj.shape)}"
            )

    @property
    def num_experts(self) -> int:
        return self.gate_proj.shape[0]

    @classmethod
    def coerce(cls, experts: object) -> SwiGLUExperts:
        """Accept any object with `gate_proj`, `up_proj`, `down_proj` tensors (duck-typed container)."""
        if isinstance(experts, cls):
            return experts
        try:
            return cls(experts.gate_proj, experts.up_proj, experts.down_proj)
        except AttributeError as error:
            raise TypeError(f"apply_experts: experts must have gate_proj, up_proj, down_proj; {error}") from None


def apply_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: object) -> torch.Tensor:
    """`out[r] = Σ_j w[r, j] · expert_{ids[r, j]}(x[r])` over in-range slots; -1 slots skipped.

    Computed in `promote_types(x.dtype, fp32)`, returned in x's dtype.
    """
    experts = SwiGLUExperts.coerce(experts)
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute).unsqueeze(-1)  # [T, H, 1]
    routed = (ids >= 0) & (ids < experts.num_experts)
    safe = torch.where(routed, ids, torch.zeros_like(ids)).to(torch.int64)
    out = torch.zeros(x.shape, dtype=compute, device=x.device)
    for j in range(ids.shape[1]):
        expert = safe[:, j]
        gate = torch.bmm(experts.gate_proj[expert].to(compute), xc)  # [T, I, 1]
        up = torch.bmm(experts.up_proj[expert].to(compute), xc)
        y = torch.bmm(experts.down_proj[expert].to(compute), torch.nn.functional.silu(gate) * up).squeeze(-1)
        contribution = weights[:, j : j + 1].to(compute) * y
        out = out + torch.where(routed[:, j : j + 1], contribution, torch.zeros_like(contribution))
    return out.to(x.dtype)

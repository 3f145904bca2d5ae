"""SwiGLU routed experts and their weighted sum, written plainly (row by row, slot by slot).

`out[r] = Σ_j w[r, j] · down_e (silu(gate_e x_r) ⊙ up_e x_r)` over the row's slots `j` with
`e = ids[r, j]`; a -1 slot contributes nothing (docs/routing.md §4: every consumer treats -1 as "no route"),
and a fused shared-expert column is just another slot whose id indexes past the routed experts.
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


def expert_forward(experts: SwiGLUExperts, expert: int, x_row: torch.Tensor) -> torch.Tensor:
    """One expert on one row, in x_row's dtype: down (silu(gate x) * up x)."""
    gate = experts.gate_proj[expert].to(x_row.dtype) @ x_row
    up = experts.up_proj[expert].to(x_row.dtype) @ x_row
    return experts.down_proj[expert].to(x_row.dtype) @ (torch.nn.functional.silu(gate) * up)


def apply_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: object) -> torch.Tensor:
    """Weighted sum of the routed (and fused shared) experts per row; -1 slots are skipped.

    Computed in `promote_types(x.dtype, fp32)`, returned in x's dtype. An id outside
    `[0, N)` other than -1 is a routing bug: it raises, naming the row and slot.
    """
    experts = SwiGLUExperts.coerce(experts)
    compute = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape, dtype=compute, device=x.device)
    host_ids = ids.cpu().tolist()
    for r in range(x.shape[0]):
        x_row = x[r].to(compute)
        for j, expert in enumerate(host_ids[r]):
            if expert == -1:
                continue
            if not 0 <= expert < experts.num_experts:
                raise ValueError(f"apply_experts: ids[{r}, {j}] = {expert} outside [0, {experts.num_experts}) and not -1")
            out[r] += weights[r, j].to(compute) * expert_forward(experts, expert, x_row)
    return out.to(x.dtype)

"""Which checkpoint tensor each parameter holds, judged by the values, not by the names.

A name map is the loader's own account of itself: a loader that filled layer 2's gen expert
`down_proj` from the und expert's tensor, with a map saying so, named every parameter honestly and
still dropped a checkpoint tensor; with the intended map it claimed a tensor the parameter does
not hold. Both are seen by comparing values: a checkpoint tensor is *received* when some
parameter holds its values, and a name-map pair (parameter, tensor) *holds* when that parameter
holds that tensor's values.

"Holds" is exact equality after the cast to the parameter's dtype (loading is a copy), in the
forms loaders store tensors: the whole parameter, rows of a fused parameter (`qkv_proj` holds
q, k and v as row blocks; rows in any order, as a loader that permutes q/k rows for interleaved
rotary stores them), columns of one (a fused input dimension), the transpose, or a contiguous
piece of a fused 1-D parameter (a fused bias). On a rank of a tensor-parallel run a parameter
holds its shard: at least 1/N of the tensor's rows or columns (docs/targets.md §11). A loader that transforms a tensor's values (folds a
scale into it, stores `1 + w`) holds none of them: its tensors are reported as not received.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn


def _rows(t: torch.Tensor) -> set[bytes]:
    """The rows of a 2-D tensor as bytes (a set: the order a loader stores rows in is its own)."""
    flat = t.detach().cpu().contiguous()
    return {bytes(row.numpy().tobytes()) for row in flat}


def _segment(haystack: torch.Tensor, needle: torch.Tensor) -> bool:
    """Whether 1-D `needle` is a contiguous piece of 1-D `haystack`."""
    n, m = needle.numel(), haystack.numel()
    if n == 0 or n > m:
        return n == 0
    starts = (haystack[: m - n + 1] == needle[0]).nonzero().flatten().tolist()
    return any(torch.equal(haystack[s : s + n], needle) for s in starts)


def holds(
    parameter: torch.Tensor,
    tensor: torch.Tensor,
    rows: Callable[[bool], set[bytes]] | None = None,
    *,
    shards: int = 1,
) -> bool:
    """Whether `parameter` holds `tensor`'s values in one of the forms a loader stores them.
    `rows(transposed)`: the parameter's row set (of its transpose when True), cached by a caller
    comparing many pairs; it must answer for this parameter whatever its address. `shards`: the
    tensor-parallel size; a rank holds its part, at least 1/`shards` of the tensor's rows or
    columns (1-D: one of its `shards` equal pieces)."""
    p = parameter.detach().cpu()
    t = tensor.detach().cpu().to(p.dtype)
    if p.shape == t.shape and torch.equal(p, t):
        return True
    if p.dim() == 1 and t.dim() == 1:
        return any(_segment(p, piece) for piece in (t.chunk(shards) if shards > 1 else (t,)))
    if p.dim() != 2 or t.dim() != 2:
        return p.numel() == t.numel() and torch.equal(p.reshape(-1), t.reshape(-1))
    parameter_rows = rows if rows is not None else (lambda transposed: _rows(p.t() if transposed else p))
    for transposed, b in ((False, t), (True, t), (False, t.t()), (True, t.t())):
        a = p.t() if transposed else p
        if a.shape[1] != b.shape[1]:
            continue
        wanted = _rows(b)
        if len(wanted & parameter_rows(transposed)) >= max(len(wanted) // shards, 1):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class Placement:
    """Per checkpoint tensor, the parameters that hold its values; and the name map's pairs that do not hold."""

    held_by: dict[str, tuple[str, ...]]  # checkpoint tensor -> parameters holding its values (empty: not received)
    misplaced: tuple[tuple[str, str], ...]  # (parameter, tensor) the name map pairs, the parameter not holding it

    @property
    def unreceived(self) -> list[str]:
        return [name for name, params in self.held_by.items() if not params]

    def holding(self, parameter: str) -> list[str]:
        """The checkpoint tensors `parameter` holds the values of."""
        return [name for name, params in self.held_by.items() if parameter in params]


def placement(
    module: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    name_map: Callable[[str], Iterable[str]],
    *,
    shards: int = 1,
) -> Placement:
    """Which parameter of `module` holds each checkpoint tensor, and which name-map pairs do not hold
    (`shards`: the tensor-parallel size, `module` being one rank's shard)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    # Each parameter's rows, computed once and keyed by its name: never by the address of the host
    # copy `holds` compares (a CUDA parameter's copy is a temporary, and the next parameter's copy
    # of the same shape may be allocated at the same address: keyed by address, it would be judged
    # by the rows of the parameter before it).
    cache: dict[tuple[str, bool], set[bytes]] = {}
    held_by: dict[str, tuple[str, ...]] = {}
    values: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        values[name] = tensor
        held_by[name] = tuple(
            p
            for p, param in params.items()
            if _may_hold(param, tensor, shards) and holds(param, tensor, rows_by_name(cache, p, param), shards=shards)
        )
    misplaced = []
    for p in params:
        for name in name_map(p):
            if name in values and p not in held_by[name]:
                misplaced.append((p, name))
    return Placement(held_by, tuple(misplaced))


def rows_by_name(cache: dict[tuple[str, bool], set[bytes]], name: str, param: torch.Tensor) -> Callable[[bool], set[bytes]]:
    """`holds`'s `rows` for parameter `name`: its host rows (of its transpose), computed once into `cache`."""

    def rows(transposed: bool) -> set[bytes]:
        if (name, transposed) not in cache:
            host = param.detach().cpu()
            cache[name, transposed] = _rows(host.t() if transposed else host)
        return cache[name, transposed]

    return rows


def _may_hold(param: torch.Tensor, tensor: torch.Tensor, shards: int = 1) -> bool:
    """A cheap shape test before comparing values: enough elements, and a dimension in common for 2-D."""
    if param.numel() * shards < tensor.numel():
        return False
    if param.dim() == 2 and tensor.dim() == 2:
        return bool(set(param.shape) & set(tensor.shape))
    return param.dim() == tensor.dim() or param.numel() == tensor.numel()


def describe(result: Placement, limit: int = 4) -> tuple[str, str]:
    """(what was not received, what the name map claims wrongly), one line each, at most `limit` named."""
    unreceived = result.unreceived
    missing = f"{len(unreceived)} checkpoint tensors no parameter holds" + (f": {unreceived[:limit]}" if unreceived else "")
    claims = []
    for p, name in result.misplaced[:limit]:
        holding = result.holding(p)
        claims.append(f"{p} does not hold {name}" + (f" (it holds {', '.join(holding[:2])})" if holding else ""))
    wrong = f"{len(result.misplaced)} name-map pairs whose parameter does not hold the tensor" + (
        f": {'; '.join(claims)}" if claims else ""
    )
    return missing, wrong


def name_map_of(mapping: Mapping[str, list[str]]) -> Callable[[str], list[str]]:
    """A target's `weight_name_map()` as the function `placement` takes (unnamed parameters: none)."""
    return lambda parameter: list(mapping.get(parameter, []))

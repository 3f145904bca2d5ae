"""Compile-only divergence: the smallest compiled piece whose output differs from the same piece run eagerly.

When a target's eager output matches the reference and its compiled output does not, the defect is
in what the compiler made of some piece. One eager run of the case catches every module's call
(its arguments, cloned); then, top-down from the root, each called child is compiled alone and run
on the arguments it received in the eager run, beside the same piece run eagerly and an fp64 copy
of it (the golden). A piece differs when its compiled output is out of the golden noise-floor bound
of its eager output; the search descends only into pieces that differ, and the answer is a
differing piece none of whose children differ (the defect is in its own code, not a child's).
Dynamo's accuracy minifier answers the same question for one compiled graph; this one names a
module of the target, which is what a porter edits.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from parity.compare import golden_noise_rule


@dataclass(frozen=True)
class PieceResult:
    path: str
    differs: bool
    value: float | None  # RMSE of the compiled output vs the fp64 golden
    bound: float | None
    detail: str = ""


@dataclass
class Bisection:
    """The pieces tried in order, and the smallest that differs (None: no single piece does)."""

    tried: list[PieceResult] = field(default_factory=list)
    piece: PieceResult | None = None

    def summary(self) -> str:
        if self.piece is None:
            return f"no compiled piece alone differs from its eager run ({len(self.tried)} pieces tried): the divergence needs pieces together"
        p = self.piece
        return (
            f"compiled {p.path or '(root)'} differs from the same module run eagerly: rmse vs fp64 {p.value:.3g} "
            f"(bound {p.bound:.3g}); none of its compiled children differs ({len(self.tried)} pieces tried)"
        )


def _clone(value: Any) -> Any:
    return pytree.tree_map(lambda leaf: leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf, value)


def catch_calls(root: nn.Module, run: Callable[[], Any]) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """Every module's last call (arguments cloned) in one eager run of the case."""
    calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    handles = []
    for path, module in root.named_modules():

        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], _path: str = path) -> None:
            calls[_path] = (_clone(args), _clone(kwargs))

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _leaves(value: Any) -> torch.Tensor:
    tensors = [
        leaf.detach().reshape(-1)
        for leaf in pytree.tree_leaves(value)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    ]
    return torch.cat([t.double() for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float64)


def _to_double(value: Any) -> Any:
    return pytree.tree_map(
        lambda leaf: leaf.double() if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf, value
    )


def try_piece(module: nn.Module, path: str, call: tuple[tuple[Any, ...], dict[str, Any]], backend: str) -> PieceResult:
    """Compile `module` alone and compare it on its eager-run arguments with its eager self."""
    args, kwargs = call
    steps = (
        ("run alone", lambda: module(*_clone(args), **_clone(kwargs))),
        ("compile alone", lambda: torch.compile(module, backend=backend, dynamic=False)(*_clone(args), **_clone(kwargs))),
        (
            "run in fp64 (the golden)",
            lambda: copy.deepcopy(module).double()(*_to_double(_clone(args)), **_to_double(_clone(kwargs))),
        ),
    )
    outputs = []
    for what, step in steps:
        try:
            with torch.no_grad():
                outputs.append(step())
        except Exception as exc:  # a piece that cannot be judged alone is not an answer
            return PieceResult(path, False, None, None, f"cannot {what}: {type(exc).__name__}: {str(exc)[:200]}")
    eager, compiled, golden = outputs
    e, c, g = _leaves(eager), _leaves(compiled), _leaves(golden)
    if not (e.shape == c.shape == g.shape) or e.numel() == 0:
        return PieceResult(path, False, None, None, "no comparable floating-point output")
    dtype = next(
        (leaf.dtype for leaf in pytree.tree_leaves(eager) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()),
        torch.float32,
    )
    verdict, _ = golden_noise_rule(g, e.to(dtype), c.to(dtype), name=path or "root")
    assert verdict.threshold is not None  # the noise-floor rule always states its bound
    return PieceResult(path, not verdict.ok, float(verdict.value), float(verdict.threshold), verdict.detail)


def bisect_compiled(root: nn.Module, run: Callable[[], Any], *, backend: str = "inductor", start: str = "") -> Bisection:
    """Top-down from `start` (a path under `root`; "" is the root): the smallest compiled piece that differs."""
    calls = catch_calls(root, run)
    result = Bisection()
    _descend(root, calls, _called_under(root, start, calls), backend, result)
    return result


def _descend(root: nn.Module, calls: dict, frontier: list[str], backend: str, result: Bisection) -> None:
    """Into the first piece of `frontier` that differs, then into its children: `result.piece` ends
    as the deepest differing piece on that path."""
    for path in frontier:
        piece = try_piece(root.get_submodule(path), path, calls[path], backend)
        result.tried.append(piece)
        if piece.differs:
            result.piece = piece
            _descend(root, calls, _called_under(root, path, calls), backend, result)
            return


def _called_under(root: nn.Module, path: str, calls: dict) -> list[str]:
    """The nearest descendants of `path` that the run called (a ModuleList is never called itself)."""
    module = root.get_submodule(path) if path else root
    prefix = f"{path}." if path else ""
    out: list[str] = []
    for name, _ in module.named_children():
        child = prefix + name
        out += [child] if child in calls else _called_under(root, child, calls)
    return out

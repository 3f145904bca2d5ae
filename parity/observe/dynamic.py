"""How parity compiles with dynamic shapes: every input dim marked dynamic, Python scalars constant.

`torch.compile(fn, dynamic=True)` makes every input size symbolic, and every plain Python float it
meets too: an `eps` or `rope_theta` held as a module attribute becomes a symbolic graph input.
Where an op needs a real float there (`F.rms_norm`'s eps), Dynamo throws the frame's analysis
away and traces it again (pytorch/pytorch#140346): on the tiny AR forward that doubled the trace
(6.6 s instead of 3.7 s per compile on a 2-core CPU; docs/capture-and-compile.md §3). A serving
engine compiles the other way (vLLM marks its token dim dynamic and leaves the rest to Dynamo's
defaults): `dynamic=None` (automatic) with the input dims marked. That is what `dynamic_compile`
does for `dynamic=True`: `torch.compile(fn, dynamic=None)`, and before every call each dim of
each tensor argument marked with `torch._dynamo.maybe_mark_dynamic` (a hint, never an error: dims
of size 0 and 1 still specialise, exactly as under `dynamic=True`). Module parameters and buffers
stay static (Dynamo's default in both spellings), Python scalars are constants until one changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from parity.observe.compile_frames import own_frame


def mark_input_dims_dynamic(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Mark every dim of every tensor in `args` / `kwargs` (nested containers included) dynamic."""
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            for dim in range(leaf.dim()):
                torch._dynamo.maybe_mark_dynamic(leaf, dim)


# The backend every compile uses instead of the one it names, when set (the quick lane,
# docs/cli.md §11): one that generates no code, so a compile-time property (recompiles, graph
# breaks, fullgraph) is still traced by Dynamo, without Inductor's seconds of code generation or
# AOTAutograd's second trace. A backend given as a callable (a test's own) is left alone.
_quick_backend: str | None = None


def generate_no_code(backend: str | None) -> None:
    """From now on compile with `backend` wherever a backend is named (None: as named again)."""
    global _quick_backend
    _quick_backend = backend


def compile_backend(backend: str | Callable[..., Any]) -> str | Callable[..., Any]:
    """The backend a compile naming `backend` gets (`generate_no_code`)."""
    return _quick_backend if isinstance(backend, str) and _quick_backend is not None else backend


def dynamic_compile(
    fn: Callable[..., Any],
    *,
    dynamic: bool | None,
    fullgraph: bool,
    backend: str | Callable[..., Any],
) -> Callable[..., Any]:
    """`torch.compile(fn)` with parity's reading of `dynamic`: True marks the inputs' dims dynamic on
    every call (above), None is Dynamo's automatic dynamic, False compiles one graph per shape. A
    decorated `fn` is compiled through a frame of its own (`parity.observe.compile_frames`)."""
    backend = compile_backend(backend)
    compiled = torch.compile(own_frame(fn), dynamic=None if dynamic else dynamic, fullgraph=fullgraph, backend=backend)
    if not dynamic:
        return compiled

    @functools.wraps(fn)
    def marked(*args: Any, **kwargs: Any) -> Any:
        mark_input_dims_dynamic(args, kwargs)
        return compiled(*args, **kwargs)

    marked._torchdynamo_orig_callable = getattr(compiled, "_torchdynamo_orig_callable", fn)  # type: ignore[attr-defined]
    return marked


def backend_text(backend: str, reason: str) -> str:
    """How a row names the backend a compile used: `backend (reason)`, or the quick lane's in its place."""
    used = compile_backend(backend)
    if used == backend:
        return f"{backend} ({reason})"
    return f"{used} (the quick lane's backend in place of {backend}: cases/quick.toml [lane], docs/cli.md §11)"

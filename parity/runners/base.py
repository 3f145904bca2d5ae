"""Pieces every execution mode shares: results, options, errors, static input buffers.

A prepared run is a callable made once per (function, example shapes) by a runner's `prepare`;
calling it with real inputs returns a `RunResult` (the function's output plus the taps). The graph
modes (`cpu_graph`, `cuda_graph`) own static input buffers: each call copies the new inputs into
them and replays, which is also where a serving engine's missing `copy_` bug lives, so the copy-in
is a method a test or a mutant can switch off (`copy_inputs=False`, or override `_copy_in`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from parity.observe.taps import Taps, TapSet

Dummy = Literal["zeros", "example"]
HostPrepare = Callable[..., None]


class CaptureError(RuntimeError):
    """Recording a graph failed; the message names the module or site being captured."""

    def __init__(self, message: str, *, site: str) -> None:
        super().__init__(message)
        self.site = site


class ReplayInputError(ValueError):
    """A replay got inputs a recorded graph cannot take (count, shape or dtype differ)."""


@dataclass(frozen=True)
class RunnerOptions:
    """Knobs of a runner. Defaults are what a serving engine does; tests flip them to break it."""

    dynamic: bool | None = True  # torch.compile(dynamic=...): True unless a case says otherwise
    fullgraph: bool = True  # a graph break is an error, not a silent split
    backend: str | Callable[..., Any] = "inductor"
    copy_inputs: bool = True  # False = the "replayed without copying new inputs" mutant
    poison_static_inputs: bool = False  # NaN-fill float static inputs before copy-in
    warmup_iters: int = 3  # cuda_graph: eager calls on a side stream before capture
    capture_error_mode: str = "global"  # torch.cuda.graph(capture_error_mode=...)


@dataclass
class RunResult:
    """What one call produced: the function's output and, per tap name, every call of the module."""

    output: Any
    taps: Taps


def describe_site(fn: Callable[..., Any], name: str | None) -> str:
    """A readable name for error messages: the given name, else the bound module's class + method."""
    if name:
        return name
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    method = getattr(fn, "__name__", None) or type(fn).__name__
    if owner is not None:
        return f"{type(owner).__name__}.{method}"
    return getattr(fn, "__qualname__", method)


_PLAIN_LEAVES = (type(None), bool, int, float, str, torch.dtype, torch.device)


def register_dataclasses(tree: Any) -> None:
    """Teach pytree the dataclass types inside `tree` (a target's output records), field by field."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        cls = type(tree)
        if cls not in pytree.SUPPORTED_NODES:
            names = [f.name for f in dataclasses.fields(cls)]

            def flatten(obj: Any, names: list[str] = names) -> tuple[list[Any], list[str]]:
                return [getattr(obj, n) for n in names], names

            def unflatten(values: Iterable[Any], names: list[str], cls: type = cls) -> Any:
                return cls(**dict(zip(names, values)))

            pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
        children = [getattr(tree, f.name) for f in dataclasses.fields(tree)]
    elif isinstance(tree, dict):
        children = list(tree.values())
    elif isinstance(tree, (list, tuple)):
        children = list(tree)
    else:
        return
    for child in children:
        register_dataclasses(child)


class OutputLayout:
    """Split a recorded function's result into its tensor leaves and put them back after a replay.

    A graph can only return tensors; anything else in the result (None, ints, strings) is what the
    Python code produced at capture time and is baked, exactly as a CUDA graph bakes it.
    """

    def __init__(self, result: Any) -> None:
        register_dataclasses(result)
        leaves, self.spec = pytree.tree_flatten(result)
        baked = [type(leaf).__name__ for leaf in leaves if not isinstance(leaf, (torch.Tensor, *_PLAIN_LEAVES))]
        if baked:
            # An opaque object would come back from every replay as the capture-time object,
            # holding the dummy inputs' tensors: refuse rather than replay stale values silently.
            raise TypeError(
                f"a recorded function returned objects the graph cannot rebuild: {sorted(set(baked))}; "
                "return tensors in tuples, lists, dicts, NamedTuples or dataclasses"
            )
        self.template = leaves
        self.tensor_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def tensors(self, result: Any) -> tuple[torch.Tensor, ...]:
        leaves = pytree.tree_leaves(result)
        return tuple(leaves[i] for i in self.tensor_slots)

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        leaves = list(self.template)
        for slot, tensor in zip(self.tensor_slots, tensors, strict=True):
            leaves[slot] = tensor
        return pytree.tree_unflatten(leaves, self.spec)


class StaticInputs:
    """Runner-owned input buffers of a recorded graph, made from the example shapes."""

    def __init__(self, examples: Sequence[torch.Tensor], *, dummy: Dummy, device: torch.device, site: str) -> None:
        if dummy not in ("zeros", "example"):
            raise ValueError(f"dummy must be 'zeros' or 'example', got {dummy!r}")
        self.site = site
        self.buffers: list[torch.Tensor] = []
        for index, example in enumerate(examples):
            if not isinstance(example, torch.Tensor):
                raise TypeError(
                    f"{site}: example input {index} is a {type(example).__name__}; graph modes take "
                    "tensors only (bind other arguments with functools.partial)"
                )
            if dummy == "zeros":
                # All-zero token ids: the dummy batch a serving engine captures on (vllm-project/vllm-omni#7318).
                self.buffers.append(torch.zeros_like(example, device=device))
            else:
                self.buffers.append(example.detach().to(device).clone())

    def check(self, inputs: Sequence[Any]) -> None:
        if len(inputs) != len(self.buffers):
            raise ReplayInputError(f"{self.site}: the graph was recorded with {len(self.buffers)} inputs, got {len(inputs)}")
        for index, (new, static) in enumerate(zip(inputs, self.buffers)):
            if not isinstance(new, torch.Tensor):
                raise ReplayInputError(f"{self.site}: input {index} is a {type(new).__name__}, not a tensor")
            if new.shape != static.shape or new.dtype != static.dtype:
                raise ReplayInputError(
                    f"{self.site}: input {index} is {tuple(new.shape)} {new.dtype} but the graph was "
                    f"recorded at {tuple(static.shape)} {static.dtype}; record one graph per shape"
                )

    def poison(self) -> None:
        """NaN-fill the float buffers so a replay that skips the copy-in shows up as NaN output.

        Integer buffers (token ids) are left alone: a sentinel id would index out of range on
        the device and kill the process instead of showing a stale result.
        """
        for buffer in self.buffers:
            if buffer.is_floating_point() or buffer.is_complex():
                buffer.fill_(math.nan)

    def copy_in(self, inputs: Sequence[torch.Tensor]) -> None:
        for static, new in zip(self.buffers, inputs):
            static.copy_(new)


class PreparedRun:
    """Base of a prepared function: call it with real inputs, get a `RunResult`."""

    mode: str = "?"
    devices: tuple[str, ...] = ()  # device types the mode runs on (the registry derives modes_for from it)

    def __init__(self, fn: Callable[..., Any], taps: TapSet, site: str, host_prepare: HostPrepare | None) -> None:
        self.fn = fn
        self.tapset = taps
        self.site = site
        self.host_prepare = host_prepare

    def _prepare_host(self, inputs: Sequence[Any]) -> None:
        # Host-side step metadata (what an engine computes on the CPU before launching a step):
        # runs outside capture, before every call, including before each replay.
        if self.host_prepare is not None:
            self.host_prepare(*inputs)

    def __call__(self, *inputs: Any) -> RunResult:
        raise NotImplementedError

    def close(self) -> None:
        """Take the tap hooks off the modules."""
        self.tapset.remove()

    def __enter__(self) -> PreparedRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RecordedFunction:
    """`fn` plus its taps as one function returning `(output, raw taps)`: what graph modes record."""

    def __init__(self, fn: Callable[..., Any], taps: TapSet) -> None:
        self.fn = fn
        self.taps = taps

    def __call__(self, *inputs: Any) -> tuple[Any, dict[str, list[tuple[Any, Any]]]]:
        self.taps.clear()
        output = self.fn(*inputs)
        return output, self.taps.raw()


def split_result(result: tuple[Any, dict[str, list[tuple[Any, Any]]]]) -> RunResult:
    output, raw = result
    return RunResult(output=output, taps=TapSet.as_taps(raw))


def clone_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # Outputs of a replay live in the graph's memory (or alias a static input / module buffer);
    # the next replay or copy-in overwrites them, so the caller gets copies.
    return [t.clone() for t in tensors]

"""`cpu_graph`: the CPU stand-in for a CUDA graph.

It records one call on dummy inputs (all-zero token ids by default, the way a serving engine
captures its dummy batch) with `make_fx` in real mode, and replays the recorded ATen graph on new
inputs of the same shapes through runner-owned static buffers. What that reproduces of a CUDA graph
(each point pinned in `tests/runners/test_runners_cpu_graph_pins.py`, so a torch upgrade that changes one
turns red):

- Python control flow and attribute state are baked: whatever branch the Python code took on the
  dummy inputs is what every replay computes (vllm-project/vllm-omni#7318: all-zero ids baked the und expert).
- Reading a tensor's value on the host while recording raises `CaptureError` naming the site:
  `.item()`, `bool(t)`, `torch.equal` (make_fx's own `_local_scalar_dense` refusal, caught first
  by our guard so the message can name the site), ops whose output shape depends on data
  (`nonzero`, boolean-mask indexing, `masked_select`, `unique`: a device sync under CUDA
  capture), and `.tolist()` / `.numpy()`, which make_fx in real mode would otherwise read
  silently from the dummy values. This is stricter than CUDA for CPU-resident tensors: keep host
  metadata as Python values made by the runner's `host_prepare` hook.
- The target's capture probe answers "capturing" while recording, through its registry.
- Module state is held by reference: a buffer updated in place (a static KV cache written with
  `index_copy_`) keeps being updated on every replay.

What it does not reproduce: CUDA's opaque error texts and the poisoned RNG after a failed capture.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from parity.observe.origin import calling_place, origin_of
from parity.runners.base import CaptureError, OutputLayout, RecordedFunction
from parity.runners.capture_probe import reporting_capture, target_sees_capturing
from parity.runners.graph import GraphRun

T = TypeVar("T")

_aten = torch.ops.aten
# Ops tagged "dynamic_output_shape" that are fine when no index is a mask / an output size is given.
_INDEX_OPS = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}
_REPEAT_INTERLEAVE = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}


def _has_mask_index(args: Sequence[Any]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in (indices or ()))


def host_sync_reason(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """Why `func` would make the host wait for a device value under capture, or None if it would not."""
    if func in _INDEX_OPS:
        return "boolean-mask indexing (its output size is the mask's count)" if _has_mask_index(args) else None
    if func in _REPEAT_INTERLEAVE:
        return None if kwargs.get("output_size") is not None else "repeat_interleave without output_size"
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags:
        return "a host read of a tensor value"
    if torch.Tag.dynamic_output_shape in tags:
        return "an op whose output shape depends on tensor values"
    return None


class _HostSyncGuard(TorchDispatchMode):
    """Raise on ops that need a tensor's value on the host; entered inside the traced function so
    it sees each op before make_fx's proxy mode does."""

    def __init__(self, site: str) -> None:
        super().__init__()
        self.site = site

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = host_sync_reason(func, args, kwargs)
        if reason is not None:
            raise CaptureError(
                f"host read of a tensor value while capturing {self.site}{calling_place()}: {func} is {reason}; "
                "a captured graph cannot branch on or size by device values",
                site=self.site,
            )
        return func(*args, **kwargs)


_HOST_COPY_METHODS = ("tolist", "numpy", "__array__")


@contextlib.contextmanager
def _no_host_copies(site: str) -> Iterator[None]:
    """Make `.tolist()` / `.numpy()` raise while recording (they bypass the dispatcher)."""
    saved: dict[str, Any] = {}
    for method in _HOST_COPY_METHODS:
        saved[method] = torch.Tensor.__dict__.get(method)

        def refuse(self: torch.Tensor, *args: Any, _method: str = method, **kwargs: Any) -> Any:
            raise CaptureError(
                f"host read of a tensor value while capturing {site}{calling_place()}: Tensor.{_method}() copies device values to the host",
                site=site,
            )

        setattr(torch.Tensor, method, refuse)
    try:
        yield
    finally:
        for method, original in saved.items():
            if original is None:
                delattr(torch.Tensor, method)
            else:
                setattr(torch.Tensor, method, original)


def on_a_shallow_stack(fn: Callable[[], T]) -> T:
    """Run `fn` in a fresh thread and return its result (or raise its exception).

    Real-mode `make_fx` builds a `FakeTensorMode` per traced value, and each one records the
    caller's whole stack (`traceback.extract_stack`, with a source line per frame). Under pytest
    that stack is about a hundred frames deep, which made recording the tiny decode step about
    seven times slower than the same recording from a script. A new thread's stack holds only the
    tracing frames. Nothing the recording depends on is thread-local except grad mode, which the
    traced function sets itself (`torch.no_grad()` inside `fn`); the capture probe and the
    host-copy guards are process-wide.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu_graph-record") as pool:
        return pool.submit(fn).result()


@contextlib.contextmanager
def _one_fake_mode() -> Iterator[None]:
    """One `FakeTensorMode` for a whole recording, for the metadata make_fx keeps of each value.

    In real mode make_fx describes every recorded value by a fake tensor, and with no fake mode
    found (`torch._guards.detect_fake_mode`, which asks the thread's tracing context first) it
    builds a new `FakeTensorMode` per value; each one extracts the caller's whole stack with a
    source line per frame. That was 40 % of recording the tiny decode step (8,944 modes for the
    decode suite's cpu_graph cases). A tracing context that holds one mode is thread-local: it
    lives in the recording thread (`on_a_shallow_stack`) and ends with the recording.
    """
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
        yield


class CpuGraphRun(GraphRun):
    """A function recorded once on dummy inputs with `make_fx`; each call copies inputs in and replays."""

    mode = "cpu_graph"
    devices = ("cpu",)

    def _record(self, recorded: RecordedFunction, registry: Any | None) -> None:
        def flat(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            with _HostSyncGuard(self.site):
                self.probe_during_capture = target_sees_capturing(registry, self.device)
                result = recorded(*inputs)
                self.layout = OutputLayout(result)
                return self.layout.tensors(result)

        def trace() -> torch.fx.GraphModule:
            with torch.no_grad(), reporting_capture(registry, self.device.type), _no_host_copies(self.site), _one_fake_mode():
                return make_fx(flat, tracing_mode="real")(*self.static.buffers)

        try:
            self.graph = on_a_shallow_stack(trace)
        except CaptureError:
            raise
        except Exception as error:  # any failure while recording is a capture failure of this site
            text = str(error)
            if "get value out of a tracing tensor" in text or "_local_scalar_dense" in text:
                message = f"host read of a tensor value while capturing {self.site}{origin_of(error)}: {text}"
            else:
                message = f"recording {self.site} for cpu_graph failed{origin_of(error)}: {type(error).__name__}: {text}"
            raise CaptureError(message, site=self.site) from error

    def _replay(self) -> Sequence[torch.Tensor]:
        with torch.no_grad():
            return self.graph(*self.static.buffers)

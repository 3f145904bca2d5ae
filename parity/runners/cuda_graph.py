"""`cuda_graph`: capture a function into a real CUDA graph the way a serving engine does.

Static input buffers made from the example shapes (all-zero dummy by default), a few eager
warm-up calls on a side stream (lazy initialisation, cuBLAS handles and autotuning must not happen
under capture), capture on the dummy inputs, then for every call: copy the new inputs into the
static buffers, replay, and clone the outputs out of the graph's private memory pool (the next
replay overwrites them). The tapped modules' inputs and outputs are extra outputs of the graph.

A failed capture is turned into `CaptureError` naming the site, because CUDA's own message does
not name the op. A failed synchronising capture leaves the process's CUDA RNG unusable, so
negative capture tests belong in a fresh process: `parity.runners.capture_isolated`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from parity.runners.base import CaptureError, OutputLayout, RecordedFunction
from parity.runners.capture_probe import target_sees_capturing
from parity.runners.graph import GraphRun


class CudaGraphRun(GraphRun):
    """A function captured once into a `torch.cuda.CUDAGraph`; each call copies inputs in and replays."""

    mode = "cuda_graph"
    devices = ("cuda",)

    def __init__(
        self, fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], *, pool: Any | None = None, **common: Any
    ) -> None:
        device = common["device"]
        if device.type != "cuda":
            raise ValueError(f"{self.mode} needs a CUDA device, got {device} (use cpu_graph on the CPU)")
        self.pool = pool
        super().__init__(fn, example_inputs, **common)

    def _record(self, recorded: RecordedFunction, registry: Any | None) -> None:
        self._warm_up(recorded)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with (
                torch.no_grad(),
                torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode=self.options.capture_error_mode),
            ):
                self.probe_during_capture = target_sees_capturing(registry, self.device)
                result = recorded(*self.static.buffers)
                self.layout = OutputLayout(result)
                self.static_outputs = self.layout.tensors(result)
        except Exception as error:
            raise CaptureError(
                f"CUDA graph capture of {self.site} failed: {type(error).__name__}: {error}\n"
                f"(CUDA does not name the op: look in {self.site} for a host read such as .item(), "
                "a Python `if` on a tensor, .nonzero(), boolean-mask indexing, .cpu() or a new "
                "host tensor; this process's CUDA RNG may now be unusable)",
                site=self.site,
            ) from error

    def _warm_up(self, recorded: RecordedFunction) -> None:
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(self.options.warmup_iters):
                    recorded(*self.static.buffers)
        except Exception as error:
            error.add_note(f"while warming up {self.site} on a side stream before CUDA graph capture")
            raise
        torch.cuda.current_stream(self.device).wait_stream(side)

    def _replay(self) -> Sequence[torch.Tensor]:
        self.graph.replay()
        return self.static_outputs

"""`cuda_graph`: capture a function into a real CUDA graph the way a serving engine does.

Static input buffers made from the example shapes (all-zero dummy by default), a few eager
warm-up calls on a side stream (lazy initialisation, cuBLAS handles and autotuning must not happen
under capture), capture on the dummy inputs, then for every call: copy the new inputs into the
static buffers, replay, and clone the outputs out of the graph's private memory pool (the next
replay overwrites them). The tapped modules' inputs and outputs are extra outputs of the graph.

A failed capture is turned into `CaptureError` naming the site, because CUDA's own message does
not name the op. A failed synchronising capture leaves the process's CUDA RNG unusable, so
negative capture tests belong in a fresh process: `parity.capture_isolated`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from parity.capture_probe import target_sees_capturing
from parity.runner_core import (
    CaptureError,
    Dummy,
    HostPrepare,
    OutputLayout,
    PreparedRun,
    RecordedFunction,
    RunnerOptions,
    RunResult,
    StaticInputs,
    clone_tensors,
    split_result,
)
from parity.taps import TapSet


class CudaGraphRun(PreparedRun):
    """A function captured once into a `torch.cuda.CUDAGraph`; each call copies inputs in and replays."""

    mode = "cuda_graph"

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        *,
        dummy: Dummy,
        taps: TapSet,
        site: str,
        host_prepare: HostPrepare | None,
        device: torch.device,
        options: RunnerOptions,
        registry: Any | None,
        pool: Any | None = None,
    ) -> None:
        super().__init__(fn, taps, site, host_prepare)
        if device.type != "cuda":
            raise ValueError(f"{self.mode} needs a CUDA device, got {device} (use cpu_graph on the CPU)")
        self.options = options
        self.device = device
        self.static = StaticInputs(example_inputs, dummy=dummy, device=device, site=site)
        self.probe_during_capture: bool | None = None
        recorded = RecordedFunction(fn, taps)
        self._prepare_host(self.static.buffers)
        self._warm_up(recorded)
        self.graph = torch.cuda.CUDAGraph()
        self.layout, self.static_outputs = self._capture(recorded, registry, pool)

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

    def _capture(
        self, recorded: RecordedFunction, registry: Any | None, pool: Any | None
    ) -> tuple[OutputLayout, tuple[torch.Tensor, ...]]:
        try:
            with torch.no_grad(), torch.cuda.graph(
                self.graph, pool=pool, capture_error_mode=self.options.capture_error_mode
            ):
                self.probe_during_capture = target_sees_capturing(registry, self.device)
                result = recorded(*self.static.buffers)
                layout = OutputLayout(result)
                outputs = layout.tensors(result)
        except Exception as error:
            raise CaptureError(
                f"CUDA graph capture of {self.site} failed: {type(error).__name__}: {error}\n"
                f"(CUDA does not name the op: look in {self.site} for a host read such as .item(), "
                "a Python `if` on a tensor, .nonzero(), boolean-mask indexing, .cpu() or a new "
                "host tensor; this process's CUDA RNG may now be unusable)",
                site=self.site,
            ) from error
        return layout, outputs

    def _copy_in(self, inputs: Sequence[torch.Tensor]) -> None:
        """Copy new inputs into the static buffers (the step a stale-buffer mutant skips)."""
        if self.options.copy_inputs:
            self.static.copy_in(inputs)

    def __call__(self, *inputs: Any) -> RunResult:
        self.static.check(inputs)
        if self.options.poison_static_inputs:
            self.static.poison()
        self._copy_in(inputs)
        self._prepare_host(inputs)
        self.graph.replay()
        return split_result(self.layout.rebuild(clone_tensors(self.static_outputs)))

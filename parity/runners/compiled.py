"""`compiled` and `compiled_cuda_graph`: `torch.compile` the function the way a serving engine does
(fullgraph, dynamic shapes), optionally capturing the compiled function into a CUDA graph."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from parity.observe.compile_ledger import CompileLedger
from parity.observe.dynamic import dynamic_compile
from parity.observe.taps import TapSet
from parity.runners.base import Dummy, HostPrepare, PreparedRun, RunnerOptions, RunResult, StaticInputs
from parity.runners.cuda_graph import CudaGraphRun


def compile_function(fn: Callable[..., Any], options: RunnerOptions, ledger: CompileLedger | None) -> Callable[..., Any]:
    """`torch.compile(fn)` with the runner's options (`dynamic=True`: the inputs' dims marked dynamic,
    `parity.observe.dynamic`), its calls counted by `ledger` when given."""
    compiled = dynamic_compile(fn, fullgraph=options.fullgraph, dynamic=options.dynamic, backend=options.backend)
    return ledger.count_calls(compiled, target=fn) if ledger is not None else compiled


class CompiledRun(PreparedRun):
    """`torch.compile(fn)`, compiled at prepare time by one call on the dummy inputs."""

    mode = "compiled"
    devices = ("cpu", "cuda")

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
        ledger: CompileLedger | None,
    ) -> None:
        super().__init__(fn, taps, site, host_prepare)
        self.compiled = compile_function(fn, options, ledger)
        warm = StaticInputs(example_inputs, dummy=dummy, device=device, site=site).buffers
        try:
            self(*warm)
        except Exception as error:
            error.add_note(f"while compiling {site} (torch.compile fullgraph={options.fullgraph}, dynamic={options.dynamic})")
            raise

    def __call__(self, *inputs: Any) -> RunResult:
        self._prepare_host(inputs)
        self.tapset.clear()
        with torch.no_grad():
            output = self.compiled(*inputs)
        return RunResult(output=output, taps=self.tapset.snapshot())


class CompiledCudaGraphRun(CudaGraphRun):
    """The compiled function captured into a CUDA graph (compile first, then capture)."""

    mode = "compiled_cuda_graph"
    devices = ("cuda",)

    def __init__(
        self, fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], *, ledger: CompileLedger | None, **common: Any
    ) -> None:
        super().__init__(compile_function(fn, common["options"], ledger), example_inputs, **common)

"""One runner interface, several execution modes.

    runner = make_runner("cpu_graph", device="cpu", capture_registry=target.capture)
    prepared = runner.prepare(adapter.decode_step, (ids, positions), taps={"mlp": layer.mlp})
    result = prepared(real_ids, real_positions)    # RunResult(output, taps)

`prepare` does what the mode does before serving (record a graph on dummy inputs, compile);
calling the prepared run does what the mode does per step (copy in and replay, run the compiled
code). Modes:

| mode | prepare | each call |
|---|---|---|
| `eager` | hooks only | call `fn` |
| `cpu_graph` | record with make_fx (real) on dummy inputs, probe says "capturing" | copy in, replay |
| `cuda_graph` | side-stream warm-up, capture on dummy inputs | copy in, replay, clone out |
| `compiled` | `torch.compile(fn, fullgraph, dynamic)`, one call on dummy inputs | call compiled |
| `compiled_cuda_graph` | compile, then capture the compiled function | copy in, replay, clone out |

Every mode returns the taps (each tapped module's first input and output, every call in order),
including replays where no Python runs. Every mode runs under `torch.no_grad()`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from parity.compile_watch import CompileLedger
from parity.cpu_graph import CpuGraphRun
from parity.cuda_graph import CudaGraphRun
from parity.runner_core import (
    CaptureError,
    Dummy,
    HostPrepare,
    PreparedRun,
    ReplayInputError,
    RunnerOptions,
    RunResult,
    StaticInputs,
    describe_site,
)
from parity.taps import TapCall, Taps, TapSet

__all__ = [
    "CPU_MODES",
    "GPU_MODES",
    "MODES",
    "CaptureError",
    "PreparedRun",
    "ReplayInputError",
    "RunResult",
    "Runner",
    "RunnerOptions",
    "TapCall",
    "Taps",
    "make_runner",
    "modes_for",
]

MODES = ("eager", "cpu_graph", "cuda_graph", "compiled", "compiled_cuda_graph")
CPU_MODES = ("eager", "cpu_graph", "compiled")
GPU_MODES = ("eager", "cuda_graph", "compiled", "compiled_cuda_graph")
_ALIASES = {"compiled+cuda_graph": "compiled_cuda_graph"}


def modes_for(device: torch.device | str) -> tuple[str, ...]:
    """The modes a suite should parametrize over on `device`."""
    return GPU_MODES if torch.device(device).type == "cuda" else CPU_MODES


class EagerRun(PreparedRun):
    mode = "eager"

    def __call__(self, *inputs: Any) -> RunResult:
        self._prepare_host(inputs)
        self.tapset.clear()
        with torch.no_grad():
            output = self.fn(*inputs)
        return RunResult(output=output, taps=self.tapset.snapshot())


class CompiledRun(PreparedRun):
    """`torch.compile(fn)`, compiled at prepare time by one call on the dummy inputs."""

    mode = "compiled"

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
        compiled = torch.compile(fn, fullgraph=options.fullgraph, dynamic=options.dynamic, backend=options.backend)
        self.compiled = ledger.count_calls(compiled, target=fn) if ledger is not None else compiled
        warm = StaticInputs(example_inputs, dummy=dummy, device=device, site=site).buffers
        try:
            self(*warm)
        except Exception as error:
            error.add_note(
                f"while compiling {site} (torch.compile fullgraph={options.fullgraph}, dynamic={options.dynamic})"
            )
            raise

    def __call__(self, *inputs: Any) -> RunResult:
        self._prepare_host(inputs)
        self.tapset.clear()
        with torch.no_grad():
            output = self.compiled(*inputs)
        return RunResult(output=output, taps=self.tapset.snapshot())


class Runner:
    """Prepares functions for one execution mode on one device."""

    def __init__(
        self,
        mode: str,
        device: torch.device,
        *,
        capture_registry: Any | None,
        options: RunnerOptions,
        ledger: CompileLedger | None,
    ) -> None:
        self.mode = mode
        self.device = device
        self.capture_registry = capture_registry
        self.options = options
        self.ledger = ledger

    def __repr__(self) -> str:
        return f"Runner({self.mode!r}, device={str(self.device)!r})"

    def prepare(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        *,
        dummy: Dummy = "zeros",
        taps: Mapping[str, nn.Module] | None = None,
        name: str | None = None,
        host_prepare: HostPrepare | None = None,
    ) -> PreparedRun:
        """Make `fn` ready to run in this mode; graph modes record on `dummy` inputs shaped like the examples.

        `fn` takes tensors only (bind the rest with functools.partial); `taps` names modules whose
        calls to record; `name` names the site in error messages (default: the bound module's
        class and method); `host_prepare(*inputs)` is host-side step preparation, run before
        every call outside any capture (before recording on the dummy inputs, before each replay
        on the real ones), the way an engine refreshes its step metadata.
        """
        site = describe_site(fn, name)
        tapset = TapSet(taps)
        examples = tuple(example_inputs)
        common = dict(dummy=dummy, taps=tapset, site=site, host_prepare=host_prepare, device=self.device)
        try:
            if self.mode == "eager":
                return EagerRun(fn, tapset, site, host_prepare)
            if self.mode == "cpu_graph":
                return CpuGraphRun(fn, examples, **common, options=self.options, registry=self.capture_registry)
            if self.mode == "cuda_graph":
                return CudaGraphRun(fn, examples, **common, options=self.options, registry=self.capture_registry)
            if self.mode == "compiled":
                return CompiledRun(fn, examples, **common, options=self.options, ledger=self.ledger)
            if self.mode == "compiled_cuda_graph":
                compiled = torch.compile(
                    fn, fullgraph=self.options.fullgraph, dynamic=self.options.dynamic, backend=self.options.backend
                )
                if self.ledger is not None:
                    compiled = self.ledger.count_calls(compiled, target=fn)
                run = CudaGraphRun(compiled, examples, **common, options=self.options, registry=self.capture_registry)
                run.mode = "compiled_cuda_graph"
                return run
        except BaseException:
            tapset.remove()
            raise
        raise AssertionError(f"unhandled mode {self.mode!r}")


def make_runner(
    mode: str,
    *,
    device: torch.device | str,
    capture_registry: Any | None = None,
    dynamic: bool | None = True,
    fullgraph: bool = True,
    backend: str | Callable[..., Any] = "inductor",
    ledger: CompileLedger | None = None,
    **knobs: Any,
) -> Runner:
    """A runner for `mode` on `device`.

    `capture_registry` is the target's capture-probe registry (`target.capture`); `ledger`
    counts the compiled modes' calls. `knobs` override `RunnerOptions` fields
    (`copy_inputs`, `poison_static_inputs`, `warmup_iters`, `capture_error_mode`).
    """
    mode = _ALIASES.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"unknown runner mode {mode!r}; modes are {', '.join(MODES)}")
    device = torch.device(device)
    if mode in ("cuda_graph", "compiled_cuda_graph") and device.type != "cuda":
        raise ValueError(f"mode {mode!r} needs a CUDA device, got {device}; on the CPU use cpu_graph")
    try:
        resolved = replace(RunnerOptions(), dynamic=dynamic, fullgraph=fullgraph, backend=backend, **knobs)
    except TypeError as error:
        raise TypeError(f"make_runner: unknown option in {sorted(knobs)}: {error}") from None
    return Runner(mode, device, capture_registry=capture_registry, options=resolved, ledger=ledger)

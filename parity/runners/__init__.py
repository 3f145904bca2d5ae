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

from parity.observe.compile_ledger import CompileLedger
from parity.observe.taps import TapCall, Taps, TapSet
from parity.runners.base import (
    CaptureError,
    Dummy,
    HostPrepare,
    PreparedRun,
    ReplayInputError,
    RunnerOptions,
    RunResult,
    describe_site,
)
from parity.runners.compiled import CompiledCudaGraphRun, CompiledRun
from parity.runners.cpu_graph import CpuGraphRun
from parity.runners.cuda_graph import CudaGraphRun
from parity.runners.eager import EagerRun
from parity.runners.graph import GraphRun

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

# The mode registry, in the order suites parametrize over it. Each mode's class declares the
# devices it runs on; `modes_for` is derived from them.
REGISTRY: dict[str, type[PreparedRun]] = {
    run.mode: run for run in (EagerRun, CpuGraphRun, CudaGraphRun, CompiledRun, CompiledCudaGraphRun)
}
MODES = tuple(REGISTRY)
_ALIASES = {"compiled+cuda_graph": "compiled_cuda_graph"}


def modes_for(device: torch.device | str) -> tuple[str, ...]:
    """The modes a suite should parametrize over on `device`."""
    kind = torch.device(device).type
    return tuple(mode for mode, run in REGISTRY.items() if kind in run.devices)


CPU_MODES = modes_for("cpu")
GPU_MODES = modes_for("cuda")


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
        common: dict[str, Any] = dict(dummy=dummy, taps=tapset, site=site, host_prepare=host_prepare, device=self.device)
        run = REGISTRY[self.mode]
        try:
            if run is EagerRun:
                return EagerRun(fn, tapset, site, host_prepare)
            if run is CompiledRun:
                return CompiledRun(fn, examples, **common, options=self.options, ledger=self.ledger)
            if run is CompiledCudaGraphRun:
                return CompiledCudaGraphRun(
                    fn, examples, **common, options=self.options, registry=self.capture_registry, ledger=self.ledger
                )
            assert issubclass(run, GraphRun)  # every other mode returned above
            return run(fn, examples, **common, options=self.options, registry=self.capture_registry)
        except BaseException:
            tapset.remove()
            raise


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
    if device.type not in REGISTRY[mode].devices:
        hint = "; on the CPU use cpu_graph" if device.type == "cpu" else ""
        raise ValueError(f"mode {mode!r} runs on {', '.join(REGISTRY[mode].devices)}, got {device}{hint}")
    try:
        resolved = replace(RunnerOptions(), dynamic=dynamic, fullgraph=fullgraph, backend=backend, **knobs)
    except TypeError as error:
        raise TypeError(f"make_runner: unknown option in {sorted(knobs)}: {error}") from None
    return Runner(mode, device, capture_registry=capture_registry, options=resolved, ledger=ledger)

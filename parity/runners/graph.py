"""What every graph mode shares: record once on dummy inputs, then copy in and replay.

`GraphRun` owns the runner's static input buffers (all-zero dummies by default, the batch a
serving engine captures on), records the function once (`_record`: `make_fx` for the CPU stand-in,
a CUDA graph capture for `cuda_graph`) and, on every call, checks the inputs, optionally poisons the
buffers, copies the new inputs in, runs the host-side step preparation, replays (`_replay`) and
clones the outputs out. The copy-in is one method (`_copy_in`), so the stale-buffer defect of a
serving engine can be switched off in one place for both graph modes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from parity.observe.taps import TapSet
from parity.runners.base import (
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


class GraphRun(PreparedRun):
    """A function recorded once on dummy inputs; each call copies inputs in and replays."""

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
    ) -> None:
        super().__init__(fn, taps, site, host_prepare)
        self.options = options
        self.device = device
        self.static = StaticInputs(example_inputs, dummy=dummy, device=device, site=site)
        self.probe_during_capture: bool | None = None
        self.layout: OutputLayout | None = None
        self._prepare_host(self.static.buffers)
        try:
            self._record(RecordedFunction(fn, taps), registry)
        finally:
            # A replay runs no Python, so the hooks have done their work: the recorded taps are
            # outputs of the graph. Left on the modules they would record every later call of them
            # (another graph's capture of the same modules, as the keyed decode graphs are), and
            # under Dynamo each call that grows their store fails a guard and recompiles.
            taps.remove()

    def _record(self, recorded: RecordedFunction, registry: Any | None) -> None:
        """Record `recorded` on the static buffers; set `self.layout` and `self.probe_during_capture`."""
        raise NotImplementedError

    def _replay(self) -> Sequence[torch.Tensor]:
        """Run the recorded graph on the static buffers; return its output tensors."""
        raise NotImplementedError

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
        tensors = self._replay()
        assert self.layout is not None
        return split_result(self.layout.rebuild(clone_tensors(tensors)))

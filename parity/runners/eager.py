"""`eager`: call the function as it is, with the taps attached (the reference point of every mode)."""

from __future__ import annotations

from typing import Any

import torch

from parity.runners.base import PreparedRun, RunResult


class EagerRun(PreparedRun):
    """Hooks only: each call runs `fn` eagerly under `torch.no_grad()`."""

    mode = "eager"
    devices = ("cpu", "cuda")

    def __call__(self, *inputs: Any) -> RunResult:
        self._prepare_host(inputs)
        self.tapset.clear()
        with torch.no_grad():
            output = self.fn(*inputs)
        return RunResult(output=output, taps=self.tapset.snapshot())

"""How parity compiles with dynamic shapes (`parity.observe.dynamic`): the input dims marked dynamic,
Python floats constant. Pinned against Dynamo's own record of each compile, with a module that holds
its RMSNorm eps as a plain float, as the serving models and most engines' models do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

from parity.observe.dynamic import dynamic_compile


class Norm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.eps = 1e-6  # a plain float attribute: what `dynamic=True` turns into a symbolic input
        self.weight = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (8,), self.weight, self.eps)


def _compiles(compile_fn, shapes: list[tuple[int, ...]]) -> list:
    torch._dynamo.reset()
    clear_compilation_metrics()
    module = Norm()
    compiled = compile_fn(module.forward)
    for shape in shapes:
        torch.testing.assert_close(compiled(torch.ones(shape)), module(torch.ones(shape)))
    return get_compilation_metrics()


def _restarts(metrics: list) -> list[str]:
    return [reason for m in metrics for reason in (m.restart_reasons or ())]


def test_dynamic_true_restarts_the_analysis_on_a_float_attribute() -> None:
    """The premise (pytorch/pytorch#140346): under `dynamic=True` the eps becomes a symbolic float,
    AOTAutograd needs a real one and Dynamo traces the frame a second time."""
    metrics = _compiles(lambda fn: torch.compile(fn, dynamic=True, fullgraph=True, backend="aot_eager"), [(3, 8)])
    assert _restarts(metrics), "torch no longer restarts here: docs/capture-and-compile.md §3 can drop the workaround"


def test_marked_dims_compile_once_without_a_restart() -> None:
    metrics = _compiles(
        lambda fn: dynamic_compile(fn, dynamic=True, fullgraph=True, backend="aot_eager"), [(3, 8), (5, 8), (7, 8)]
    )
    assert _restarts(metrics) == []
    assert len(metrics) == 1, "one graph, dynamic in the marked dims, serves every row count >= 2"


@pytest.mark.parametrize("dynamic", [True, "marked"])
def test_size_one_specialises_as_under_dynamic_true(dynamic) -> None:
    """Dims of size 0 and 1 specialise either way (docs/capture-and-compile.md §3), so the recompile
    suites' expected counts do not depend on the spelling."""
    if dynamic is True:
        make = lambda fn: torch.compile(fn, dynamic=True, fullgraph=True, backend="eager")
    else:
        make = lambda fn: dynamic_compile(fn, dynamic=True, fullgraph=True, backend="eager")
    assert len(_compiles(make, [(3, 8), (1, 8), (4, 8)])) == 2


def test_static_shapes_compile_per_shape() -> None:
    """`dynamic=False` keeps its meaning (the static-shapes mutant of the catalogue relies on it)."""
    make = lambda fn: dynamic_compile(fn, dynamic=False, fullgraph=True, backend="eager")
    assert len(_compiles(make, [(3, 8), (5, 8), (7, 8)])) == 3

"""Pins: the make_fx (real mode) behaviours `cpu_graph` is built on.

These call torch directly, not the runner. If a torch upgrade changes one of them, the matching
test turns red and says which property of the CUDA-graph stand-in needs a new foundation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from parity.runners.base import CaptureError
from parity.runners.cpu_graph import _HostSyncGuard
from tests.support.runners_toys import fake_modes_made


def _trace(fn, *inputs):
    with torch.no_grad():
        return make_fx(fn, tracing_mode="real")(*inputs)


def test_pin_python_bool_branch_is_baked():
    state = {"negate": False}

    def fn(x):
        return -x if state["negate"] else x + 1

    graph = _trace(fn, torch.zeros(2))
    state["negate"] = True
    torch.testing.assert_close(graph(torch.ones(2)), torch.full((2,), 2.0))


def test_pin_shape_is_baked_into_views():
    # A Python-level shape read becomes a constant: the graph is only valid at the traced shape.
    graph = _trace(lambda x: x.reshape(x.shape[0] * 2), torch.zeros(2, 2))
    with pytest.raises(RuntimeError):
        graph(torch.zeros(3, 2))


def test_pin_host_read_of_a_traced_value_raises_local_scalar_dense():
    # cpu_graph's fallback message matching (runner_core) relies on this wording.
    with pytest.raises(RuntimeError, match=r"_local_scalar_dense"):
        _trace(lambda x: x * x.sum().item(), torch.ones(2))


def test_pin_tolist_and_numpy_read_dummy_values_silently():
    # Why cpu_graph patches Tensor.tolist/numpy while recording: make_fx lets them through and the
    # decision they feed is baked from the dummy values.
    graph = _trace(lambda x: x + float(sum(x.tolist())), torch.zeros(2))
    torch.testing.assert_close(graph(torch.ones(2)), torch.ones(2))
    graph = _trace(lambda x: x + float(x.numpy().sum()), torch.zeros(2))
    torch.testing.assert_close(graph(torch.ones(2)), torch.ones(2))


def test_pin_data_dependent_shape_ops_trace_without_error():
    # Why cpu_graph guards nonzero / mask indexing itself: make_fx records them as ops, while a
    # CUDA capture must sync to size their outputs and fails.
    graph = _trace(lambda x: x[x > 0], torch.zeros(3))
    assert graph(torch.tensor([1.0, -1.0, 2.0])).shape == (2,)


def test_pin_op_tags_the_guard_reads():
    aten = torch.ops.aten
    assert torch.Tag.data_dependent_output in aten._local_scalar_dense.default.tags
    assert torch.Tag.data_dependent_output in aten.equal.default.tags
    assert torch.Tag.dynamic_output_shape in aten.nonzero.default.tags
    assert torch.Tag.dynamic_output_shape in aten.masked_select.default.tags


def test_pin_a_mode_entered_inside_the_traced_function_sees_ops_first():
    def fn(x):
        with _HostSyncGuard("pin site"):
            return x[x.nonzero()[:, 0]]

    with pytest.raises(CaptureError, match=r"while capturing pin site.*: aten\.nonzero"):
        _trace(fn, torch.zeros(3))


def test_pin_buffers_and_parameters_are_held_by_reference():
    layer = nn.Linear(2, 2)
    layer.register_buffer("cache", torch.zeros(3, 2))

    def fn(pos, x):
        layer.cache.index_copy_(0, pos, layer(x))
        return layer.cache.sum(0)

    graph = _trace(fn, torch.zeros(1, dtype=torch.long), torch.zeros(1, 2))
    with torch.no_grad():
        layer.cache.zero_()
        layer.weight.copy_(torch.eye(2))
        layer.bias.zero_()
        graph(torch.tensor([2]), torch.tensor([[3.0, 4.0]]))
    # The in-place write landed in the module's own buffer, computed with the new weights.
    torch.testing.assert_close(layer.cache[2], torch.tensor([3.0, 4.0]))


def test_pin_hook_recorded_tensors_become_fresh_graph_outputs():
    layer = nn.Linear(2, 2)
    seen = []
    layer.register_forward_hook(lambda module, args, out: seen.append(out.clone()))

    def fn(x):
        seen.clear()
        out = layer(x) * 2
        return out, list(seen)

    graph = _trace(fn, torch.zeros(1, 2))
    x = torch.ones(1, 2)
    out, taps = graph(x)
    with torch.no_grad():
        torch.testing.assert_close(taps[0], layer(x))


def test_pin_real_mode_takes_its_fake_mode_from_the_tracing_context():
    # Why cpu_graph records inside a tracing context of its own (`_one_fake_mode`): without one,
    # real-mode make_fx builds a fake mode for each value it records; with one, it uses that one.
    from parity.runners.cpu_graph import _one_fake_mode

    def fn(x):
        for _ in range(8):
            x = torch.tanh(x) * 2
        return x

    alone = fake_modes_made(lambda: _trace(fn, torch.zeros(4)))
    assert alone >= 16, f"make_fx built {alone} fake modes for 16 recorded ops: the per-value modes this pin assumes are gone"

    def in_context():
        with _one_fake_mode():
            return _trace(fn, torch.zeros(4))

    assert fake_modes_made(in_context) == 1

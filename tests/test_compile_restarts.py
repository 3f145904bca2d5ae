"""Compiling the serving models with `dynamic=True` restarts no Dynamo analysis.

Under `dynamic=True` a plain float a module reads (an epsilon, a RoPE base, an attention scale)
becomes a symbolic input; ops that need a real float make Dynamo specialize it and trace the
whole frame again (docs/capture-and-compile.md §3, "Restarts"). The serving models hold those
floats as `ArchConstant`; these tests read Dynamo's own record of each compile
(`restart_reasons`) and go red when one float is plain again. `aot_eager` is enough: the restart
comes from the pass that turns symbolic floats into tensors, before Inductor.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

from serving_models.ar.adapter import ServingARAdapter
from serving_models.dit import model as dit_model
from tests.ar_support import mixed_ids
from tests.dit_support import tiny_pair

pytestmark = pytest.mark.cpu


def restart_reasons(compile_and_run: Callable[[], object]) -> set[str]:
    """Why Dynamo restarted any analysis while `compile_and_run` ran (empty: it never did)."""
    torch._dynamo.reset()
    clear_compilation_metrics()
    try:
        compile_and_run()
        return {reason for metrics in get_compilation_metrics() for reason in metrics.restart_reasons}
    finally:
        torch._dynamo.reset()


def compile_ar(adapter: ServingARAdapter, method: str) -> Callable[[], object]:
    compiled = torch.compile(getattr(adapter, method), fullgraph=True, dynamic=True, backend="aot_eager")
    return lambda: compiled(mixed_ids())


def compile_dit_blocks(serving) -> Callable[[], object]:
    """The regional compile the recompiles suite does, then one CFG sampler step."""
    for module in serving.module.modules():
        if type(module).__name__ in serving.module._repeated_blocks:
            module.forward = torch.compile(module.forward, fullgraph=True, dynamic=True, backend="aot_eager")
    text, mask = serving.text_condition(4, seed=0)
    return lambda: serving.sample(text, mask, 32, 32, steps=1, guidance_scale=4.0, seed=0)


@pytest.fixture
def ar(tiny_dir) -> ServingARAdapter:
    return ServingARAdapter.load(tiny_dir)


@pytest.mark.parametrize("method", ["embed", "forward"])
def test_the_serving_ar_compiles_without_a_restart(ar, method):
    assert restart_reasons(compile_ar(ar, method)) == set()


def test_the_serving_dit_blocks_compile_without_a_restart():
    _, serving = tiny_pair()
    assert restart_reasons(compile_dit_blocks(serving)) == set()


# The same checks on broken variants: one architecture float held as a plain float again.


def test_a_plain_float_rmsnorm_epsilon_restarts_the_ar_forward(ar):
    norm = ar.module.language_model.model.norm
    norm.variance_epsilon = float(norm.variance_epsilon)
    assert restart_reasons(compile_ar(ar, "forward"))


def test_nn_embeddings_norm_type_restarts_the_ar_embed(ar, monkeypatch):
    monkeypatch.setattr(type(ar.module.language_model.model.embed_tokens), "forward", torch.nn.Embedding.forward)
    assert restart_reasons(compile_ar(ar, "embed"))


def test_a_plain_float_attention_scale_restarts_the_dit_blocks():
    _, serving = tiny_pair()
    for module in serving.module.modules():
        if isinstance(module, dit_model.Attention):
            module.scale = float(module.scale)
    assert restart_reasons(compile_dit_blocks(serving))

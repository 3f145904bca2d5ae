"""The AR adapter surface, identical on both targets, and what the suites will observe through it."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from reference_models.ar import model as ref
from reference_models.ar.adapter import ReferenceARAdapter
from serving_models.ar import model as srv
from serving_models.ar.adapter import ServingARAdapter
from serving_models.common.capture import capture_probe
from tests.support.ar_support import START, TINY, mixed_ids
from tests.support.noise_checks import assert_same_greedy

TARGETS = ["reference", "serving"]
ADAPTER_METHODS = [
    "moe_sites",
    "embedding_modules",
    "weight_name_map",
    "embed",
    "forward",
    "forward_multimodal",
    "allocate_decode_state",
    "prefill",
    "decode_step",
    "greedy_generate",
]


@pytest.fixture(params=TARGETS)
def adapter(request):
    return request.getfixturevalue(request.param)


def test_both_adapters_expose_the_same_surface() -> None:
    for cls in (ReferenceARAdapter, ServingARAdapter):
        for method in ADAPTER_METHODS:
            assert callable(getattr(cls, method)), (cls, method)
        for attr in ("name", "capture", "supports_capture", "load", "build", "config", "moe_layers"):
            assert hasattr(cls, attr), (cls, attr)
    for method in ("forward", "forward_multimodal", "greedy_generate", "decode_step"):
        ref_params = list(inspect.signature(getattr(ReferenceARAdapter, method)).parameters)
        srv_params = list(inspect.signature(getattr(ServingARAdapter, method)).parameters)
        assert ref_params == srv_params, method
    assert ReferenceARAdapter.supports_capture is False and ServingARAdapter.supports_capture is True


def test_structure(adapter) -> None:
    assert isinstance(adapter.module, nn.Module)
    assert adapter.moe_layers == (2, 3) == TINY.moe_layers
    assert adapter.config.moe_type == "ffn-2:4" and adapter.config.gen_vocab_start_index == START
    for backend_api in ("register_capture_probe", "capture_probe", "is_capturing"):
        assert callable(getattr(adapter.capture, backend_api))
    sites = adapter.moe_sites()
    assert [s.layer for s in sites] == [2, 3]
    for site in sites:
        assert site.pre_norm is site.layer_module.post_attention_layernorm
        assert site.und is site.layer_module.mlp and site.gen is site.layer_module.gen_mlp
    out = adapter.forward(mixed_ids())
    assert out.logits.shape == (3, 12, TINY.logits_width)
    assert len(out.hidden_states) == TINY.num_hidden_layers
    assert all(h.shape == (3, 12, TINY.hidden_size) for h in out.hidden_states)


def routing_errors(adapter, ids: torch.Tensor) -> list[str]:
    """Per MoE site and token: was the layer's output `h + gen(x)` for gen ids and `h + und(x)` otherwise?

    Observed only through forward hooks on the site modules, never by asking the target.
    """
    seen: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    for site in adapter.moe_sites():
        handles.append(
            site.pre_norm.register_forward_hook(
                lambda _m, args, out, i=site.layer: seen.update({(i, "h"): args[0], (i, "x"): out})
            )
        )
        handles.append(
            site.layer_module.register_forward_hook(lambda _m, _args, out, i=site.layer: seen.update({(i, "out"): out}))
        )
    try:
        adapter.forward(ids)
    finally:
        for h in handles:
            h.remove()
    errors = []
    is_gen = ids >= START
    with torch.no_grad():
        for site in adapter.moe_sites():
            h, x, out = seen[site.layer, "h"], seen[site.layer, "x"], seen[site.layer, "out"]
            with_und, with_gen = h + site.und(x), h + site.gen(x)
            for b, t in torch.cartesian_prod(torch.arange(ids.shape[0]), torch.arange(ids.shape[1])).tolist():
                used, other = (with_gen, with_und) if is_gen[b, t] else (with_und, with_gen)
                # rows an expert saw as a subset vs all rows: GEMM-shape rounding only, far below the experts' gap
                if not torch.allclose(out[b, t], used[b, t], rtol=1e-5, atol=1e-6) or torch.allclose(
                    out[b, t], other[b, t], atol=1e-4
                ):
                    errors.append(f"layer {site.layer} token ({b}, {t}) id {int(ids[b, t])}")
    return errors


def test_moe_sites_show_per_token_routing(adapter) -> None:
    assert routing_errors(adapter, mixed_ids()) == []


@pytest.mark.parametrize("target", TARGETS)
def test_routing_check_catches_gen_mlp_never_called(request, monkeypatch, target) -> None:
    adapter = request.getfixturevalue(target)
    if target == "reference":
        monkeypatch.setattr(ref, "moe_forward", lambda h, und, gen, mask: und(h))
    else:
        monkeypatch.setattr(srv, "moe_dispatch", lambda h, und, gen, mask, name: und(h))
    assert routing_errors(adapter, mixed_ids()) != []


def test_reference_embedding_modules_see_the_upstream_lookup(reference) -> None:
    ids = mixed_ids()
    seen = {}
    base, gen = reference.embedding_modules()
    handles = [
        base.register_forward_pre_hook(lambda _m, a: seen.__setitem__("base", a[0])),
        gen.register_forward_pre_hook(lambda _m, a: seen.__setitem__("gen", a[0])),
    ]
    reference.embed(ids)
    for h in handles:
        h.remove()
    is_gen = ids >= START
    assert torch.equal(seen["base"], torch.where(is_gen, 0, ids))  # gen positions looked up as id 0
    assert torch.equal(seen["gen"], ids[is_gen] - START)  # only the gen rows, as offsets


def test_multimodal_entry_derives_the_mask_from_ids(adapter) -> None:
    ids = mixed_ids()
    embeds = adapter.embed(ids)
    assert torch.equal(adapter.forward_multimodal(embeds, ids).logits, adapter.forward(ids).logits)


def test_decode_api_matches_greedy(adapter) -> None:
    # row 0 text only, row 1 mixed; with the seed's checkpoint both rows' greedy tokens cross into gen ids
    prompt = torch.tensor([[3, 17, 42, 99], [8, START + 3, 50, START + 9]])
    generated = adapter.greedy_generate(prompt, 5)
    assert generated.tokens.shape == (2, 5) and generated.step_logits.shape == (2, 5, TINY.logits_width)
    assert torch.equal(generated.tokens, generated.step_logits.argmax(-1))
    adapter.allocate_decode_state(2, 9)
    logits = adapter.prefill(prompt)[:, -1]
    torch.testing.assert_close(logits, generated.step_logits[:, 0])
    for i in range(4):
        logits = adapter.decode_step(generated.tokens[:, i : i + 1], torch.full((2,), 4 + i))
        torch.testing.assert_close(logits, generated.step_logits[:, i + 1])  # fp32 noise at most


def test_greedy_agrees_across_targets(reference, serving) -> None:
    # row 0 text only, row 1 mixed; with the seed's checkpoint both rows' greedy tokens cross into gen ids
    prompt = torch.tensor([[3, 17, 42, 99], [8, START + 3, 50, START + 9]])
    ref_gen, srv_gen = reference.greedy_generate(prompt, 6), serving.greedy_generate(prompt, 6)
    # Two implementations round differently (SDPA vs materialised softmax, static-length decode
    # attention): step logits at fp32 noise (assert_close defaults), tokens equal up to a tie flip.
    assert_same_greedy(ref_gen, srv_gen)
    assert (ref_gen.tokens >= START).any(), "the prompt should lead into gen tokens, exercising gen decode"


def test_decode_rederives_the_mask_each_step(tiny_dir) -> None:
    adapter = ServingARAdapter.load(tiny_dir)
    gen_rows = []
    hook = adapter.moe_sites()[0].gen.register_forward_hook(
        lambda _m, a, _o: gen_rows.append(a[0].reshape(-1, TINY.hidden_size).shape[0])
    )
    adapter.allocate_decode_state(2, 8)
    adapter.prefill(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))  # text only: gen_mlp idle
    assert gen_rows == []
    adapter.decode_step(torch.tensor([[START], [9]]), torch.full((2,), 4))  # one gen token: one gen row
    adapter.decode_step(torch.tensor([[10], [11]]), torch.full((2,), 5))  # text again: idle again
    adapter.decode_step(torch.tensor([[START + 1], [START + 2]]), torch.full((2,), 6))  # all gen
    hook.remove()
    assert gen_rows == [1, 2]


def test_greedy_through_a_captured_step(tiny_dir) -> None:
    """The decode suite's path: capture on zeros, then prefill and replay the graph step by step."""
    eager = ServingARAdapter.load(tiny_dir)
    captured = ServingARAdapter.load(tiny_dir)
    # row 0 text only, row 1 mixed; with the seed's checkpoint both rows' greedy tokens cross into gen ids
    prompt = torch.tensor([[3, 17, 42, 99], [8, START + 3, 50, START + 9]])
    captured.allocate_decode_state(2, 10)
    with capture_probe("cpu", lambda: True):
        graph = make_fx(captured.decode_step, tracing_mode="real")(
            torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, dtype=torch.long)
        )
    replayed = captured.greedy_generate(prompt, 6, step_fn=graph)
    want = eager.greedy_generate(prompt, 6)
    # eager decode gathers mixed rows per expert, the graph blends all rows: GEMM-shape rounding, so
    # step logits at fp32 noise and tokens equal up to a tie flip
    assert_same_greedy(want, replayed)

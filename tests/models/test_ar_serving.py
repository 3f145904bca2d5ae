"""The serving port's graph-safety behaviours (docs/model.md §4, §5): lookup clamps, capture-aware MoE dispatch,
fail-closed capture, a capturable decode step, raw input tokens, pipeline tensors, Qwen3 identity."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from serving_models.ar import model as srv
from serving_models.ar import runner as ar_runner
from serving_models.ar.adapter import ServingARAdapter
from serving_models.ar.config import QWEN3_MODEL_TYPE
from serving_models.common.capture import capture_probe
from tests.support.ar_support import GEN_LAST, LAYOUT, START, TINY, mixed_ids

CAPTURING = lambda: True


# ---- clamped dual lookup ------------------------------------------------------------------


def lookup_indices(adapter: ServingARAdapter, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The indices each embedding table's forward received while embedding `ids`."""
    seen: dict[str, torch.Tensor] = {}
    base, gen = adapter.embedding_modules()
    hooks = [
        base.register_forward_pre_hook(lambda _m, args: seen.__setitem__("base", args[0].clone())),
        gen.register_forward_pre_hook(lambda _m, args: seen.__setitem__("gen", args[0].clone())),
    ]
    try:
        adapter.embed(ids)
    except IndexError:
        pass  # an unclamped lookup; the recorded indices show why
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def out_of_range(seen: dict[str, torch.Tensor], ids: torch.Tensor) -> list[str]:
    sizes = {"base": TINY.vocab_size, "gen": TINY.gen_vocab_size}
    problems = [f"{name} index {int(i)}" for name, idx in seen.items() for i in idx.flatten() if not 0 <= i < sizes[name]]
    problems += [f"{name} did not look up every token" for name in sizes if name not in seen or seen[name].shape != ids.shape]
    return problems


EDGE_IDS = torch.tensor([[-1, 0, START - 1, START, GEN_LAST, GEN_LAST + 1, 10**12]])


def test_dual_lookup_is_clamped_and_selects_per_token(serving) -> None:
    assert out_of_range(lookup_indices(serving, EDGE_IDS), EDGE_IDS) == []
    base, gen = (m.weight for m in serving.embedding_modules())
    emb = serving.embed(EDGE_IDS)[0]
    want = [base[0], base[0], base[START - 1], gen[0], gen[-1], gen[-1], gen[-1]]
    for row, expected in zip(emb, want, strict=True):
        assert torch.equal(row, expected)


@pytest.mark.parametrize(
    "name, mutant",
    [
        ("clamp_gen_ids", lambda ids, start, size: ids - start),
        ("clamp_base_ids", lambda ids, size: ids.clamp_min(0)),
    ],
)
def test_lookup_check_catches_an_unclamped_side(serving, monkeypatch, name, mutant) -> None:
    monkeypatch.setattr(srv, name, mutant)
    assert out_of_range(lookup_indices(serving, EDGE_IDS), EDGE_IDS) != []


# ---- MoE dispatch ------------------------------------------------------------------------


class RowCounter:
    """Forward hooks that count the rows each expert ran on."""

    def __init__(self, **experts: nn.Module) -> None:
        self.rows = {name: [] for name in experts}
        self.handles = [
            m.register_forward_hook(
                lambda _m, args, _o, n=name: self.rows[n].append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
            )
            for name, m in experts.items()
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.fixture
def experts():
    torch.manual_seed(0)
    und, gen = srv.SwiGLUMLP(TINY).requires_grad_(False), srv.SwiGLUMLP(TINY).requires_grad_(False)
    x = torch.randn(2, 5, TINY.hidden_size)
    mixed = torch.tensor([[True, False, False, True, False], [False, False, True, False, False]])
    return und, gen, x, mixed


def test_eager_dispatch_keeps_the_fast_paths(experts) -> None:
    und, gen, x, mixed = experts
    cases = {
        "none": (None, [10], []),
        "all_und": (torch.zeros_like(mixed), [10], []),
        "all_gen": (torch.ones_like(mixed), [], [10]),
        "mixed": (mixed, [7], [3]),
    }
    for case, (mask, und_rows, gen_rows) in cases.items():
        counter = RowCounter(und=und, gen=gen)
        out = srv.moe_dispatch(x, und, gen, mask, "model.layers.2")
        counter.remove()
        assert (counter.rows["und"], counter.rows["gen"]) == (und_rows, gen_rows), case
        want = und(x) if mask is None else torch.where(mask[..., None], gen(x), und(x))
        torch.testing.assert_close(out, want)  # row subsets vs all rows: GEMM-shape rounding only


def test_capture_blends_both_experts_even_for_an_all_false_mask(experts) -> None:
    und, gen, x, mixed = experts
    for mask in (torch.zeros_like(mixed), mixed, torch.ones_like(mixed)):
        counter = RowCounter(und=und, gen=gen)
        with capture_probe("cpu", CAPTURING):
            out = srv.moe_dispatch(x, und, gen, mask, "model.layers.2")
        counter.remove()
        assert counter.rows == {"und": [10], "gen": [10]}
        assert torch.equal(out, torch.where(mask[..., None], gen(x), und(x)))


def test_capture_without_a_mask_fails_closed(experts) -> None:
    und, gen, x, _ = experts
    with capture_probe("cpu", CAPTURING), pytest.raises(RuntimeError) as info:
        srv.moe_dispatch(x, und, gen, None, "model.layers.14")
    message = str(info.value)
    assert "model.layers.14" in message and "enforce_eager" in message
    assert "PIECEWISE is not a workaround" in message and "FULL_DECODE_ONLY" not in message
    with capture_probe("cpu", CAPTURING):  # a layer without a gen expert needs no mask
        assert torch.equal(srv.moe_dispatch(x, und, None, None, "model.layers.0"), und(x))


def capture_without_mask_raises(adapter: ServingARAdapter, ids: torch.Tensor) -> bool:
    with capture_probe("cpu", CAPTURING):
        try:
            adapter.forward(inputs_embeds=adapter.embed(ids))
        except RuntimeError as err:
            return "model.layers.2" in str(err)
    return False


def test_model_fails_closed_and_a_fail_open_mutant_is_caught(serving, monkeypatch) -> None:
    ids = mixed_ids()
    assert capture_without_mask_raises(serving, ids)
    real = srv.moe_dispatch

    def fail_open(hidden, und, gen, mask, layer_name):
        return und(hidden) if mask is None else real(hidden, und, gen, mask, layer_name)

    monkeypatch.setattr(srv, "moe_dispatch", fail_open)
    assert not capture_without_mask_raises(serving, ids)


def test_eager_embeddings_without_mask_run_und_everywhere(serving) -> None:
    ids = mixed_ids()
    embeds = serving.embed(ids)
    hazard = serving.forward(inputs_embeds=embeds).logits
    assert torch.equal(
        hazard, serving.forward(inputs_embeds=embeds, gen_token_mask=torch.zeros_like(ids, dtype=torch.bool)).logits
    )
    assert not torch.allclose(hazard, serving.forward(ids).logits)


# ---- a capturable decode step (make_fx real mode as the CPU stand-in) ----------------------------

HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.masked_select")


def trace_decode_step(adapter: ServingARAdapter, batch: int, max_len: int | None) -> torch.fx.GraphModule:
    """Capture on all-zero dummy ids, as a runner does at start-up (before any prefill); `max_len`
    None keeps the decode state already allocated (several graphs on one state)."""
    if max_len is not None:
        adapter.allocate_decode_state(batch, max_len)
    dummy_ids = torch.zeros(batch, 1, dtype=torch.long)
    dummy_positions = torch.zeros(batch, dtype=torch.long)
    with capture_probe("cpu", CAPTURING):
        return make_fx(adapter.decode_step, tracing_mode="real")(dummy_ids, dummy_positions)


def test_decode_step_captured_on_zeros_replays_gen_tokens(tiny_dir, reference) -> None:
    adapter = ServingARAdapter.load(tiny_dir)
    graph = trace_decode_step(adapter, batch=2, max_len=12)
    ops = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert not [op for op in ops if op.startswith(HOST_READS)], ops
    state = adapter.decode_state
    cache = [t.data_ptr() for t in state.keys + state.values]

    prompt = torch.tensor([[5, 9, 262, 300], [7, 8, 9, 10]])
    adapter.prefill(prompt)
    sequence = prompt
    # gen, text, EOL/gen, text: each step's routing comes from that step's ids
    for step, column in enumerate([[LAYOUT.eol, 40], [41, 300], [GEN_LAST, 42]]):
        ids = torch.tensor(column)[:, None]
        positions = torch.full((2,), prompt.shape[1] + step)
        logits = graph(ids, positions)
        sequence = torch.cat([sequence, ids], dim=1)
        want = reference.forward(sequence)
        torch.testing.assert_close(logits, want.logits[:, -1])  # fp32 noise (SDPA vs materialised softmax)
        # the same step with the new token forced onto the und expert differs: gen rows took gen_mlp
        forced = sequence >= START
        forced[:, -1] = False
        und_only = reference.forward(inputs_embeds=reference.embed(sequence), gen_token_mask=forced).logits[:, -1]
        for row in range(2):
            if ids[row, 0] >= START:
                assert (logits[row] - und_only[row]).abs().max() > 1e-3
    assert [t.data_ptr() for t in state.keys + state.values] == cache  # the static cache was updated in place


def test_host_branch_dispatch_under_capture_is_caught(tiny_dir, monkeypatch) -> None:
    adapter = ServingARAdapter.load(tiny_dir)
    monkeypatch.setattr(
        srv, "moe_dispatch", lambda h, und, gen, mask, name: und(h) if gen is None else srv.moe_eager(h, und, gen, mask)
    )
    with pytest.raises(RuntimeError, match="_local_scalar_dense"):
        trace_decode_step(adapter, batch=2, max_len=8)


def test_prefill_and_decode_equal_the_full_forward(serving) -> None:
    ids = mixed_ids(batch=2, length=9)
    serving.allocate_decode_state(2, 9)
    prefill = serving.prefill(ids[:, :6])
    torch.testing.assert_close(prefill, serving.forward(ids[:, :6]).logits)  # static-length attention: fp32 noise
    full = serving.forward(ids).logits
    for pos in range(6, 9):
        step = serving.decode_step(ids[:, pos : pos + 1], torch.full((2,), pos))
        torch.testing.assert_close(step, full[:, pos])


# ---- mask-keyed decode graphs (docs/model.md §4) ------------------------------------------------


def test_decode_graph_key_is_the_batch_composition_from_host_state() -> None:
    assert ar_runner.decode_graph_key([False, False]) == ar_runner.UND_ONLY
    assert ar_runner.decode_graph_key([True, True]) == ar_runner.GEN_ONLY  # every request inside an image
    assert ar_runner.decode_graph_key([False, True]) == ar_runner.BLEND  # a mix: the blend
    assert ar_runner.decode_graph_key([True, None]) == ar_runner.BLEND  # a token the host does not know
    assert ar_runner.decode_graph_key([None]) == ar_runner.BLEND
    assert ar_runner.decode_graph_key([]) == ar_runner.UND_ONLY
    with pytest.raises(TypeError, match="device-to-host sync"):
        ar_runner.decode_graph_key(torch.tensor([False, True]))


def _expert_calls(adapter: ServingARAdapter) -> tuple[dict[str, int], list]:
    """Forward calls of the und and gen experts of the MoE layers, counted by hooks (and the hooks)."""
    calls = {"und": 0, "gen": 0}
    hooks = []
    for site in adapter.moe_sites():
        for name, module in (("und", site.und), ("gen", site.gen)):
            hooks.append(module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1)))
    return calls, hooks


@pytest.mark.parametrize(
    ("key", "absent", "kept_row", "poisoned_row"),
    [(ar_runner.UND_ONLY, "gen", [40], [START + 3]), (ar_runner.GEN_ONLY, "und", [START + 3], [40])],
    ids=["und_only", "gen_only"],
)
def test_single_expert_graph_runs_one_expert_and_poisons_a_broken_promise(
    tiny_dir, key: str, absent: str, kept_row: list[int], poisoned_row: list[int]
) -> None:
    """A single-expert key, captured on zeros: the other expert is not in the graph, rows of its
    own kind equal the blend's (a single-expert step), and a row of the other kind replayed on it
    comes out NaN (never routed to the wrong expert quietly)."""
    adapter = ServingARAdapter.load(tiny_dir)
    calls, hooks = _expert_calls(adapter)
    adapter.allocate_decode_state(2, 8)
    adapter.select_decode_graph(key)
    try:
        keyed_graph = trace_decode_step(adapter, batch=2, max_len=None)
    finally:
        adapter.select_decode_graph(None)
        for hook in hooks:
            hook.remove()
    assert calls[absent] == 0 and calls["und" if absent == "gen" else "gen"] > 0  # the blend's recording calls both
    blend_graph = trace_decode_step(adapter, batch=2, max_len=None)
    prompt = torch.tensor([[5, 9, 11, 4], [7, 8, 9, 10]])
    adapter.prefill(prompt)
    positions = torch.full((2,), 4)
    same_kind = torch.tensor([kept_row, [kept_row[0] + 1]])
    torch.testing.assert_close(keyed_graph(same_kind, positions), blend_graph(same_kind, positions), rtol=0, atol=0)
    mixed = torch.tensor([kept_row, poisoned_row])
    logits = keyed_graph(mixed, positions)
    assert torch.isfinite(logits[0]).all() and torch.isnan(logits[1]).all()


def test_select_decode_graph_rejects_unknown_keys(serving) -> None:
    with pytest.raises(ValueError, match="unknown decode graph key"):
        serving.select_decode_graph("all_gen")
    assert serving.decode_graph_keys == (ar_runner.UND_ONLY, ar_runner.GEN_ONLY, ar_runner.BLEND)


# ---- raw input tokens on the multimodal path --------------------------------------------------


def test_requires_raw_input_tokens_is_declared_and_read() -> None:
    for module_type in (
        srv.MammothModa2Qwen2ARForConditionalGeneration,
        srv.MammothModa2Qwen3ARForConditionalGeneration,
        srv.MammothModa2ForConditionalGeneration,
    ):
        assert module_type.requires_raw_input_tokens is True, module_type
    ids, embeds = torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 4)
    keep, drop = nn.Module(), nn.Module()
    keep.requires_raw_input_tokens = True
    assert ar_runner.prepare_model_inputs(keep, ids, embeds)["input_ids"] is ids
    assert ar_runner.prepare_model_inputs(drop, ids, embeds)["input_ids"] is None
    assert ar_runner.prepare_model_inputs(drop, ids, None)["input_ids"] is ids


def test_multimodal_entry_routes_gen_tokens_only_with_raw_tokens(serving, monkeypatch) -> None:
    ids = mixed_ids()
    embeds = serving.embed(ids)
    assert torch.equal(serving.forward_multimodal(embeds, ids).logits, serving.forward(ids).logits)
    monkeypatch.setattr(serving.module, "requires_raw_input_tokens", False)  # vllm-project/vllm-omni#9851
    dropped = serving.forward_multimodal(embeds, ids).logits
    assert torch.equal(dropped, serving.forward(inputs_embeds=embeds).logits)
    assert not torch.allclose(dropped, serving.forward(ids).logits)


# ---- pipeline parallel and the Qwen3 variant ---------------------------------------------------


def test_constructor_installs_the_gen_mask_factory(monkeypatch) -> None:
    calls = []
    real = srv.make_empty_intermediate_tensors_with_gen_mask

    def spy(batch_size, hidden_size, dtype, device, seq_len=1):
        calls.append((batch_size, hidden_size, seq_len))
        return real(batch_size, hidden_size, dtype, device, seq_len)

    monkeypatch.setattr(srv, "make_empty_intermediate_tensors_with_gen_mask", spy)
    lm = srv.MammothModa2Qwen2ForCausalLM(TINY, start_layer=2)
    tensors = lm.make_empty_intermediate_tensors(3, torch.float32, "cpu")
    top = srv.MammothModa2ForConditionalGeneration(TINY)
    top.make_empty_intermediate_tensors(2, torch.float32, "cpu", seq_len=4)
    assert calls == [(3, TINY.hidden_size, 1), (2, TINY.hidden_size, 4)]
    assert tensors["gen_token_mask"].dtype == torch.bool and not tensors["gen_token_mask"].any()
    assert tensors["gen_token_mask"].shape == (3, 1) and tensors["hidden_states"].shape == (3, 1, TINY.hidden_size)


def test_pipeline_stages_carry_the_mask(serving) -> None:
    full = serving.module.language_model
    first = srv.MammothModa2Qwen2ForCausalLM(TINY, end_layer=2)
    second = srv.MammothModa2Qwen2ForCausalLM(TINY, start_layer=2)
    for stage in (first, second):
        # assign=True: the stages hold the full model's very tensors (same memory, same alignment),
        # so the staged forward runs the same kernels on the same operands and may be compared
        # bitwise; copies would sit at other alignments, which CPU GEMMs may round differently.
        stage.load_state_dict(full.state_dict(), assign=True)
        stage.requires_grad_(False)
    ids = mixed_ids()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    sent = first(ids, positions)
    assert isinstance(sent, srv.IntermediateTensors) and torch.equal(sent["gen_token_mask"], ids >= START)
    received = second.make_empty_intermediate_tensors(ids.shape[0], torch.float32, "cpu", seq_len=ids.shape[1])
    for name, tensor in received.items():
        tensor.copy_(sent[name])  # static receive buffers, copied in before a (replayed) step
    assert torch.equal(second.compute_logits(second(None, positions, received)), serving.forward(ids).logits)
    # without the seeded mask a later stage has nothing to route by: under capture it fails closed
    with capture_probe("cpu", CAPTURING), pytest.raises(RuntimeError, match="model.layers.2"):
        second(None, positions, srv.IntermediateTensors(hidden_states=sent["hidden_states"]))


def test_qwen3_variant_shares_forward_and_embedding() -> None:
    assert srv.MammothModa2Qwen3ForCausalLM.forward is srv.MammothModa2Qwen2ForCausalLM.forward
    assert srv.MammothModa2Qwen3ForCausalLM.get_input_embeddings is srv.MammothModa2Qwen2ForCausalLM.get_input_embeddings
    torch.manual_seed(0)
    top = srv.MammothModa2ForConditionalGeneration(TINY.replace(model_type=QWEN3_MODEL_TYPE)).requires_grad_(False)
    assert isinstance(top.ar, srv.MammothModa2Qwen3ARForConditionalGeneration)
    layer = top.language_model.model.layers[2]
    assert layer.self_attn.q_norm is not None and layer.self_attn.qkv_proj.bias is None and layer.gen_mlp is not None
    adapter = ServingARAdapter(top)
    ids = mixed_ids(batch=2, length=7)
    adapter.allocate_decode_state(2, 7)
    adapter.prefill(ids[:, :6])
    torch.testing.assert_close(adapter.decode_step(ids[:, 6:], torch.full((2,), 6)), adapter.forward(ids).logits[:, -1])


# ---- the KV cache under Inductor ----------------------------------------------------------


def test_compiled_cache_writes_stay_in_place() -> None:
    """Inductor writes an indexed assignment into a whole per-layer cache tensor in place; a
    `scatter_`, or any write into a view of one stacked buffer, becomes a copy of the cache, the
    write, attention over the copy and a copy back (docs/model.md §4). Both writers of the serving
    model (the Qwen2 RoPE + cache write, the Qwen3 `update`), two layers, then a read: the compiled
    code allocates no buffer of a layer cache's shape, and the caches hold the writes."""
    from torch._inductor.utils import run_and_get_code

    from serving_models.ar import kernels

    config = dataclasses.replace(TINY, num_hidden_layers=2)
    batch, max_len, heads, kv_heads, dim = 2, 16, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    cache = srv.StaticKVCache.allocate(config, batch, max_len, torch.device("cpu"), torch.float32)
    qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * dim)
    ones, zeros = torch.ones(batch, 1, 1, dim), torch.zeros(batch, 1, 1, dim)
    positions = torch.tensor([[3], [7]])
    k, v = torch.randn(batch, kv_heads, 1, dim), torch.randn(batch, kv_heads, 1, dim)

    def step(qkv, k, v, positions):
        kernels.rope_and_cache_write_torch(qkv, ones, zeros, positions, cache.keys[0], cache.values[0], heads)
        keys, values = cache.update(1, k, v, positions)
        return cache.keys[0].sum() + cache.values[0].sum() + keys.sum() + values.sum()

    _, code = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=False), qkv, k, v, positions)
    shape = f"({batch}, {kv_heads}, {max_len}, {dim})"
    copies = [line.strip() for text in code for line in text.splitlines() if "empty_strided" in line and shape in line]
    assert not copies, f"the compiled step copies a layer's KV cache: {copies}"
    for row, position in enumerate(positions[:, 0].tolist()):
        assert torch.equal(cache.keys[1][row, :, position], k[row, :, 0])
        assert torch.equal(cache.values[0][row, :, position], qkv[row, 0, (heads + kv_heads) * dim :].view(kv_heads, dim))

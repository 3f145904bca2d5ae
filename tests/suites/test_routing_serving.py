"""The serving router: equals the reference, batch-invariant, graph-safe (traced replay follows the
device count, fullgraph compile), and each guarded behaviour goes red under its mutant."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx

import serving_models.routing.router as serving_routing
from reference_models.routing import router as reference_routing
from tests.support.noise_checks import routing_tie_flips

NAN = float("nan")

# docs/routing.md §2: weights of two implementations agree within |Δw| <= 2e-5 (the ROCm/ATOM and
# vLLM top-k test bound); ids must be equal.
WEIGHT_ATOL = 2e-5


def grouped_kwargs(num_experts: int, seed: int) -> dict:
    groups = 8 if num_experts % 8 == 0 and num_experts >= 32 else 4 if num_experts % 4 == 0 else 1
    generator = torch.Generator().manual_seed(seed)
    return dict(
        scoring="sigmoid",
        correction_bias=-torch.rand(num_experts, generator=generator) - 1,  # all keys negative: the 0.0-mask trap
        num_expert_group=groups,
        topk_group=max(1, groups // 2),
        routed_scaling_factor=2.5,
    )


# ---- serving == reference ------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts,k,rows", [(8, 2, 7), (40, 4, 17), (64, 8, 33), (256, 8, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("kind", ["softmax", "grouped"])
def test_serving_equals_reference(num_experts, k, rows, dtype, renormalize, kind):
    seed = num_experts * 1000 + k * 10 + rows
    generator = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(rows, num_experts, generator=generator)).to(dtype)
    logits[0, :3] = torch.tensor([NAN, float("inf"), float("-inf")]).to(dtype)  # R2 rides along
    kwargs = dict(renormalize=renormalize, num_shared_experts=1)
    if kind == "grouped":
        kwargs.update(grouped_kwargs(num_experts, seed))
    n_valid = torch.tensor([rows - 1], dtype=torch.int32)
    expected = reference_routing.select_experts(logits, k, num_valid_rows=n_valid, **kwargs)
    got = serving_routing.select_experts(logits, k, num_valid_rows=n_valid, **kwargs)
    assert torch.equal(got.ids, expected.ids)
    assert (got.weights - expected.weights).abs().max().item() <= WEIGHT_ATOL


# ---- the tie-break key ---------------------------------------------------------------------------


def test_tie_break_key_keeps_the_order_of_distinct_fp32_keys():
    tiny = torch.finfo(torch.float32).tiny
    specials = torch.tensor([0.0, -0.0, tiny, -tiny, tiny / 8, -tiny / 8, 1.0, -1.0, 3.4e38, -3.4e38, float("-inf")])
    base = torch.randn(200) * torch.logspace(-30, 30, 200)
    neighbours = torch.cat([torch.nextafter(base, torch.full_like(base, float("inf"))), base])  # 1-ulp gaps
    keys = torch.cat([specials, neighbours, base[:50]])  # the last 50 repeat: exact ties
    order = torch.topk(serving_routing.tie_break_order_key(keys.unsqueeze(0)), keys.numel()).indices[0].tolist()
    expected = sorted(range(keys.numel()), key=lambda i: (-keys[i].item(), i))  # R3 written out
    assert order == expected


def test_sigmoid_bits_do_not_depend_on_position():
    # torch.sigmoid rounds its vectorized body and scalar tail differently on CPU; the router's
    # σ must give one value the same bits wherever it sits (R3 ties, R8 invariance).
    values = torch.randn(4099) * 6
    whole = serving_routing.sigmoid_fp32(values)
    one_by_one = torch.cat([serving_routing.sigmoid_fp32(values[i : i + 1]) for i in range(values.numel())])
    assert torch.equal(whole, one_by_one)


# ---- R8 batch invariance -------------------------------------------------------------------------


def routed(logits, n_valid=None, **kwargs):
    count = None if n_valid is None else torch.tensor([n_valid], dtype=torch.int32)
    return serving_routing.select_experts(logits, 8, num_valid_rows=count, **kwargs)


@pytest.mark.parametrize("kind", ["softmax", "softmax_full", "grouped"])
def test_batch_invariance(kind):
    generator = torch.Generator().manual_seed(7)
    kwargs = {"softmax": dict(renormalize=True), "softmax_full": dict(renormalize=False)}.get(kind)
    if kwargs is None:
        kwargs = dict(renormalize=True, **grouped_kwargs(64, 7))
    pool = torch.randn(600, 64, generator=generator)
    pool[::5] = pool[::5].round()  # integer rows: many exact ties
    probe = pool[:8]
    alone = [routed(probe[i : i + 1], **kwargs) for i in range(8)]
    for rows in (1, 8, 64, 512):
        for where in ("front", "back"):
            mates = pool[8 : 8 + rows]
            batch = torch.cat([probe, mates]) if where == "front" else torch.cat([mates, probe])
            start = 0 if where == "front" else rows
            for n_valid in (None, batch.shape[0], start + 8):
                result = routed(batch, n_valid, **kwargs)
                for i in range(8):
                    got = (result.weights[start + i], result.ids[start + i])
                    assert torch.equal(got[1], alone[i].ids[0]) and torch.equal(got[0], alone[i].weights[0]), (
                        f"row {i}, {rows} mates at the {where}, n_valid={n_valid}"
                    )


# ---- graph safety ----------------------------------------------------------------------------------


CAPACITY = 16


def capture_fn(**kwargs):
    def route(logits, count, bias):
        extra = dict(correction_bias=bias) if kwargs.get("scoring") == "sigmoid" else {}
        return tuple(serving_routing.select_experts(logits, 4, num_valid_rows=count, **kwargs, **extra))

    return route


CAPTURE_CASES = {
    "softmax": dict(renormalize=False, num_shared_experts=1),
    "grouped": dict(
        scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5, num_shared_experts=2
    ),
}


def replay_with_counts(fn, counts) -> None:
    """Trace once on dummy inputs with the count buffer, then replay while the runner writes each
    step's count into the SAME buffer; each replay must equal eager bit for bit."""
    generator = torch.Generator().manual_seed(11)
    count = torch.full((1,), CAPACITY, dtype=torch.int32)  # the persistent device buffer
    logits = torch.zeros(CAPACITY, 32)  # static input buffer, dummy contents at capture
    bias = -torch.rand(32, generator=generator) - 1
    graph = make_fx(fn, tracing_mode="real")(logits, count, bias)
    for step, n in enumerate(counts):
        logits.copy_(torch.randn(CAPACITY, 32, generator=generator))
        logits[max(n, 0) :] = NAN  # pad rows hold garbage
        count.fill_(n) if step % 2 else count.copy_(torch.tensor([n], dtype=torch.int32))
        replayed = graph(logits, count, bias)
        eager = fn(logits, count, bias)
        real = min(max(n, 0), CAPACITY)
        assert (replayed[1][real:] == -1).all(), f"replay with n_valid={n}: pad rows routed"
        for got, want in zip(replayed, eager):
            assert torch.equal(got, want), f"replay with n_valid={n} differs from eager"


@pytest.mark.parametrize("case", sorted(CAPTURE_CASES))
def test_traced_replay_follows_the_device_count(case):
    replay_with_counts(capture_fn(**CAPTURE_CASES[case]), [CAPACITY, CAPACITY // 2, 1, 0, CAPACITY, -1, CAPACITY + 3])


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parity_slow  # one Inductor compile: ~3-10 s on the shared 2-core CPU box
def test_compiles_fullgraph_with_inductor(fresh_dynamo):
    fn = capture_fn(**CAPTURE_CASES["grouped"])
    compiled = torch.compile(fn, fullgraph=True)
    generator = torch.Generator().manual_seed(12)
    logits, bias = torch.randn(CAPACITY, 32, generator=generator), -torch.rand(32, generator=generator) - 1
    count = torch.tensor([CAPACITY], dtype=torch.int32)
    options = dict(CAPTURE_CASES["grouped"], correction_bias=bias)
    for n in (CAPACITY, 5, 0):
        count.fill_(n)
        got, want = compiled(logits, count, bias), fn(logits, count, bias)
        # Inductor computes the keys with its own sigmoid: ids equal up to a tie flip (none on this
        # input on the machines measured), pad rows exactly -1 (an integer fill).
        flips = routing_tie_flips(logits[:n], want[1][:n], got[1][:n], 4, options)
        assert torch.equal(got[1][n:], want[1][n:]), f"pad rows at n_valid={n}"
        kept = torch.ones(CAPACITY, dtype=torch.bool)
        kept[flips] = False
        # Inductor generates its own exp / fused arithmetic: measured 4.5e-8 on these weights (<= 2.5),
        # i.e. a few fp32 ulps; 1e-6 is still 20x below the cross-implementation bound.
        assert (got[0][kept] - want[0][kept]).abs().max().item() <= 1e-6


@pytest.mark.parametrize("case", sorted(CAPTURE_CASES))
def test_compiles_fullgraph_without_breaks(case, fresh_dynamo):
    fn = capture_fn(**CAPTURE_CASES[case])
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    logits, count, bias = torch.randn(CAPACITY, 32), torch.tensor([7], dtype=torch.int32), -torch.rand(32) - 1
    for got, want in zip(compiled(logits, count, bias), fn(logits, count, bias)):
        assert torch.equal(got, want)


def test_python_count_is_refused():
    with pytest.raises(TypeError, match="num_valid_rows must be a device tensor"):
        serving_routing.select_experts(torch.randn(4, 8), 2, renormalize=True, num_valid_rows=3)


# ---- mutants: each guarded behaviour goes red ------------------------------------------------------


def check_pad_rows_masked() -> None:
    logits = torch.randn(8, 16)
    logits[5:] = NAN
    result = serving_routing.select_experts(
        logits, 2, renormalize=True, num_shared_experts=1, num_valid_rows=torch.tensor([5], dtype=torch.int32)
    )
    assert (result.ids[5:] == -1).all() and (result.weights[5:] == 0).all(), "pad rows dispatched"


def check_lowest_id_ties() -> None:
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 0.0, 0.0, 0.0]])
    for scoring in ("softmax", "sigmoid"):
        ids = serving_routing.select_experts(tied, 2, scoring=scoring, renormalize=True).ids
        assert ids.tolist() == [[1, 2]], f"ties not broken toward the lowest id: {ids.tolist()}"


def ignore_pad_rows(weights, ids, row_is_real):
    return weights, ids


def highest_id_first(keys):
    n = keys.shape[-1]
    bits = torch.where(keys == 0, torch.zeros_like(keys), keys).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return ordered * (1 << 32) + torch.arange(n, dtype=torch.int64)


def host_read_count(num_valid_rows, num_rows):
    n = min(max(int(num_valid_rows.reshape(-1)[0]), 0), num_rows)
    return torch.full((1,), n, dtype=torch.int64, device=num_valid_rows.device)


def test_checks_pass_on_the_real_router():
    check_pad_rows_masked()
    check_lowest_id_ties()


def test_mutant_ignoring_num_valid_rows_is_caught(monkeypatch):
    monkeypatch.setattr(serving_routing, "mask_pad_rows", ignore_pad_rows)
    with pytest.raises(AssertionError, match="pad rows dispatched"):
        check_pad_rows_masked()
    with pytest.raises(AssertionError, match="pad rows routed"):
        replay_with_counts(capture_fn(**CAPTURE_CASES["softmax"]), [CAPACITY, 3])


def test_mutant_breaking_ties_toward_the_highest_id_is_caught(monkeypatch):
    monkeypatch.setattr(serving_routing, "tie_break_order_key", highest_id_first)
    with pytest.raises(AssertionError, match="lowest id"):
        check_lowest_id_ties()


def test_mutant_reading_the_count_on_the_host_cannot_be_captured(monkeypatch):
    monkeypatch.setattr(serving_routing, "valid_row_count", host_read_count)
    fn = capture_fn(**CAPTURE_CASES["softmax"])
    check_pad_rows_masked()  # eager still looks right: only capture exposes the host read
    with pytest.raises(RuntimeError, match="_local_scalar_dense"):
        make_fx(fn, tracing_mode="real")(torch.zeros(CAPACITY, 32), torch.tensor([CAPACITY], dtype=torch.int32), torch.zeros(32))


def test_mutant_with_a_baked_count_replays_stale(monkeypatch):
    """A count read on the host and baked in at capture (what a CUDA graph does with a Python int):
    eager stays right, the replay keeps the capture-time count, and the replay check sees it."""

    def baked_count(num_valid_rows, num_rows):
        with disable_proxy_modes_tracing():  # read the real value even while tracing
            n = min(max(int(num_valid_rows.reshape(-1)[0]), 0), num_rows)
        return torch.full((1,), n, dtype=torch.int64, device=num_valid_rows.device)

    monkeypatch.setattr(serving_routing, "valid_row_count", baked_count)
    check_pad_rows_masked()  # eager is right
    with pytest.raises(AssertionError, match="differs from eager|pad rows routed"):
        replay_with_counts(capture_fn(**CAPTURE_CASES["softmax"]), [CAPACITY, CAPACITY // 2])


@pytest.mark.parametrize("rows,k", list(itertools.product([1, 7], [1, 4])))
def test_zero_rows_and_small_shapes(rows, k):
    for n in (0, rows):
        result = serving_routing.select_experts(
            torch.randn(rows, 8), k, renormalize=True, num_valid_rows=torch.tensor([n], dtype=torch.int32)
        )
        assert tuple(result.ids.shape) == (rows, k)
    empty = serving_routing.select_experts(torch.randn(0, 8), 2, renormalize=True)
    assert tuple(empty.ids.shape) == (0, 2) and empty.weights.dtype == torch.float32

"""Consumers of routed ids (docs/routing.md §4-§6): EPLB remap, the per-expert load counter and the expert apply,
each treating -1 as "no route"; reference and serving side by side, plus their mutants."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import serving_models.routing.router as serving_routing
from reference_models.routing.adapter import make_router as make_reference_router
from serving_models.routing.adapter import make_router as make_serving_router

REFERENCE, SERVING = make_reference_router(), make_serving_router()
ROUTERS = {"reference": REFERENCE, "serving": SERVING}


@pytest.fixture(params=sorted(ROUTERS))
def router(request):
    return ROUTERS[request.param]


def ids_with_holes(rows: int, num_logical: int, seed: int) -> torch.Tensor:
    """Random logical ids with ~10% -1 and a few ids >= E (shared columns, sentinels)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_logical, (rows, 4), generator=generator, dtype=torch.int32)
    holes = torch.rand(rows, 4, generator=generator)
    ids[holes < 0.1] = -1
    ids[holes > 0.95] = num_logical + 1
    return ids


def replica_table(num_logical: int, replicas: int) -> torch.Tensor:
    """Expert e lives at physical e (and, with 2 replicas, also at E + e for even e only)."""
    table = torch.full((num_logical, replicas), -1, dtype=torch.int32)
    table[:, 0] = torch.arange(num_logical)
    if replicas == 2:
        table[::2, 1] = num_logical + torch.arange(0, num_logical, 2)
    return table


def check_remap(router, rows: int, replicas: int) -> None:
    num_logical = 8
    ids = ids_with_holes(rows, num_logical, seed=rows * 10 + replicas)
    table = replica_table(num_logical, replicas)
    choice = torch.arange(rows, dtype=torch.int32) * 7 + 3  # depends on the row only
    physical = router.remap(ids, table, choice)
    assert physical.dtype == ids.dtype and physical.shape == ids.shape
    outside = (ids < 0) | (ids >= num_logical)
    assert torch.equal(physical[outside], ids[outside]), "-1 / out-of-range ids must pass through"
    # Physical ids map back to the same logical ids.
    back = torch.where(physical >= num_logical, physical - num_logical, physical)
    assert torch.equal(back[~outside], ids[~outside]), "remap changed a logical expert"
    for r in range(rows):  # replica choice: choice(row) mod replicas(expert)
        for j in range(ids.shape[1]):
            e = int(ids[r, j])
            if 0 <= e < num_logical and e % 2 == 0 and replicas == 2:
                assert int(physical[r, j]) == int(table[e, int(choice[r]) % 2])


@pytest.mark.parametrize("rows", [0, 1, 17, 512])
@pytest.mark.parametrize("replicas", [1, 2])
def test_remap_passes_minus_one_and_out_of_range_through(router, rows, replicas):
    check_remap(router, rows, replicas)


def test_remap_without_in_range_guard_is_caught(monkeypatch):
    def unguarded(ids, table, row_choice):  # checks the upper bound only: -1 indexes the last expert
        table = table.to(torch.int64)
        below_end = ids < table.shape[0]
        safe = torch.where(below_end, ids, torch.zeros_like(ids)).to(torch.int64)
        slot = row_choice.to(torch.int64).unsqueeze(1) % (table >= 0).sum(1)[safe]
        return torch.where(below_end, table[safe, slot].to(ids.dtype), ids)

    monkeypatch.setattr(serving_routing, "remap_to_physical", unguarded)
    with pytest.raises(AssertionError, match="pass through"):
        check_remap(SERVING, 17, 1)


def check_expert_load(router, count: int) -> None:
    rows, num_physical = 12, 6
    ids = torch.tensor([[0, 1, -1], [1, 1, 5], [6, -1, -1], [2, 3, 4]] * 3, dtype=torch.int32)
    n_valid = torch.tensor([count], dtype=torch.int32)
    load = router.expert_load(ids, n_valid, num_physical)
    expected = torch.zeros(num_physical, dtype=torch.int64)
    for r in range(min(max(count, 0), rows)):
        for e in ids[r].tolist():
            if 0 <= e < num_physical:
                expected[e] += 1
    assert load.dtype == torch.int64 and torch.equal(load, expected), f"n_valid={count}: {load.tolist()} != {expected.tolist()}"


@pytest.mark.parametrize("count", [0, 1, 5, 12, 15, -1])
def test_expert_load_counts_real_rows_and_valid_ids_only(router, count):
    check_expert_load(router, count)


def test_expert_load_is_capture_safe_and_follows_the_count():
    ids = torch.randint(-1, 9, (16, 4), dtype=torch.int32)
    count = torch.tensor([16], dtype=torch.int32)
    graph = make_fx(lambda i, n: serving_routing.expert_load(i, n, 8), tracing_mode="real")(ids, count)
    for n in (16, 9, 0, -1, 20):
        count.fill_(n)
        assert torch.equal(graph(ids, count), REFERENCE.expert_load(ids, n, 8)), n


def test_expert_load_ignoring_the_count_is_caught(monkeypatch):
    monkeypatch.setattr(serving_routing, "row_is_real", lambda n, rows, device: None)
    with pytest.raises(AssertionError, match="n_valid=5"):
        check_expert_load(SERVING, 5)


# ---- apply ---------------------------------------------------------------------------------------


def make_experts(router, num_experts: int, hidden: int, inter: int, seed: int):
    generator = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=generator) / shape[-1] ** 0.5

    return router.make_experts(w(num_experts, inter, hidden), w(num_experts, inter, hidden), w(num_experts, hidden, inter))


def test_apply_matches_a_dense_sum_and_skips_minus_one(router):
    rows, num_experts, hidden, inter, k = 10, 8, 16, 24, 2
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(rows, hidden, generator=generator)
    experts = make_experts(router, num_experts + 1, hidden, inter, seed=6)  # + 1 fused shared expert
    logits = torch.randn(rows, num_experts, generator=generator)
    logits[3, 1:] = float("nan")  # one candidate: slot 1 is -1
    result = router.select_experts(
        logits, k, renormalize=True, num_shared_experts=1, num_valid_rows=torch.tensor([8], dtype=torch.int32)
    )
    x[8:] = float("nan")  # pad rows hold garbage; their slots are all -1
    out = router.apply_experts(x, result, experts)

    def expert(e, v):
        return experts.down_proj[e].double() @ (
            torch.nn.functional.silu(experts.gate_proj[e].double() @ v) * (experts.up_proj[e].double() @ v)
        )

    for r in range(rows):
        want = torch.zeros(hidden, dtype=torch.float64)
        for w, e in zip(result.weights[r].tolist(), result.ids[r].tolist()):
            if e >= 0:
                want += w * expert(e, x[r].double())
        # fp32 matmuls of width <= 24 against fp64: ~1e-6 relative on O(1) outputs
        torch.testing.assert_close(out[r].double(), want, rtol=0, atol=1e-5)
    assert (out[8:] == 0).all() and torch.isfinite(out).all()


def test_serving_apply_equals_reference_apply():
    rows, num_experts, hidden, inter = 12, 8, 8, 16
    x = torch.randn(rows, hidden)
    experts = make_experts(SERVING, num_experts, hidden, inter, seed=8)
    result = SERVING.select_experts(torch.randn(rows, num_experts), 3, renormalize=False)
    ids = result.ids.clone()
    ids[::4, 1] = -1
    weights = torch.where(ids >= 0, result.weights, torch.zeros_like(result.weights))
    pair = SERVING.RoutingResult(weights, ids)
    # Same products, different matmul blocking (bmm vs per-row matvec): a few fp32 ulps.
    torch.testing.assert_close(
        SERVING.apply_experts(x, pair, experts), REFERENCE.apply_experts(x, pair, experts), rtol=0, atol=1e-5
    )


def test_reference_apply_rejects_an_out_of_range_id():
    experts = make_experts(REFERENCE, 4, 8, 8, seed=9)
    result = REFERENCE.RoutingResult(torch.ones(1, 1), torch.tensor([[4]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"ids\[0, 0\] = 4"):
        REFERENCE.apply_experts(torch.randn(1, 8), result, experts)


def test_serving_apply_multiplying_minus_one_slots_by_zero_is_caught(monkeypatch):
    """The fused apply drops -1 slots with `where`; a version that multiplies by the 0 weight
    turns a NaN pad row into NaN output (0 · NaN)."""
    import serving_models.routing.experts as moe_experts

    original = moe_experts.apply_experts

    def multiply_by_zero(x, weights, ids, experts):
        safe = torch.where(ids >= 0, ids, torch.zeros_like(ids))
        return original(x, weights, safe, experts)  # weight 0 on the former -1 slots

    experts = make_experts(SERVING, 4, 8, 8, seed=10)
    x = torch.randn(3, 8)
    x[2] = float("nan")
    pair = SERVING.RoutingResult(torch.tensor([[1.0], [1.0], [0.0]]), torch.tensor([[0], [1], [-1]], dtype=torch.int32))
    assert torch.isfinite(SERVING.apply_experts(x, pair, experts)).all()
    monkeypatch.setattr(moe_experts, "apply_experts", multiply_by_zero)
    assert not torch.isfinite(SERVING.apply_experts(x, pair, experts)).all()


def test_apply_is_capture_safe():
    experts = make_experts(SERVING, 5, 8, 8, seed=11)
    x = torch.randn(6, 8)
    result = SERVING.select_experts(torch.randn(6, 4), 2, renormalize=True, num_shared_experts=1)
    fn = lambda x, w, i: SERVING.apply_experts(x, (w, i), experts)
    graph = make_fx(fn, tracing_mode="real")(x, *result)
    assert torch.equal(graph(x, *result), fn(x, *result))

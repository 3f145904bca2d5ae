"""Each routing rule of docs/routing.md on hand-built rows, for the reference and the serving router.

Expected ids are written out by hand from the rules, never computed by either router, so the two
routers are each checked against the rules and not only against one another.
"""

from __future__ import annotations

import math

import pytest
import torch

from reference_models.routing.adapter import make_router as make_reference_router
from serving_models.routing.adapter import make_router as make_serving_router

NAN, INF = float("nan"), float("inf")
ROUTERS = {"reference": make_reference_router(), "serving": make_serving_router()}


@pytest.fixture(params=sorted(ROUTERS))
def router(request):
    return ROUTERS[request.param]


def rows(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def assert_contract(result, rows_: int, width: int) -> None:
    """The contract (docs/routing.md §1 and R7): a NamedTuple (weights, ids), int32 ids, fp32 weights, [T, k + S]."""
    assert result._fields == ("weights", "ids")
    weights, ids = result
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert tuple(ids.shape) == tuple(weights.shape) == (rows_, width)
    assert torch.isfinite(weights).all() and (weights >= 0).all()
    for r in range(rows_):
        valid = [int(e) for e in ids[r] if e >= 0]
        assert len(valid) == len(set(valid)), f"row {r}: duplicate ids {ids[r].tolist()}"
        assert (weights[r][ids[r] < 0] == 0).all(), f"row {r}: weight on a -1 slot"


# ---- R3: order and ties ------------------------------------------------------------------------


def check_ties(router) -> None:
    """Equal keys: the lower expert id ranks first (all-zero row, plateau, tie at the k cut, slot 0)."""
    plateau = (torch.arange(16) % 7 - 3).float()
    cases = [
        (torch.zeros(1, 8), 3, [[0, 1, 2]]),
        (plateau.unsqueeze(0), 4, [[6, 13, 5, 12]]),
        (rows([5.0, 4.0, 1.0, 4.0, 4.0, 0.0, 0.0, 0.0]), 3, [[0, 1, 3]]),
        (rows([1.0, 7.0, 0.0, 7.0, 7.0, 0.0, 0.0, 7.0]), 2, [[1, 3]]),
        (rows([2.0, -0.0, 3.0, 0.0, -1.0, -1.0, -1.0, -1.0]), 3, [[2, 0, 1]]),  # -0.0 == 0.0
    ]
    for logits, k, expected in cases:
        result = router.select_experts(logits, k, renormalize=True)
        assert_contract(result, logits.shape[0], k)
        assert result.ids.tolist() == expected, f"{logits.tolist()} k={k}: {result.ids.tolist()} != {expected}"
    # Equal logits get equal weights.
    assert torch.equal(router.select_experts(torch.zeros(1, 8), 4, renormalize=True).weights, torch.full((1, 4), 0.25))


def test_ties_go_to_the_lowest_id(router):
    check_ties(router)


def test_integer_valued_logits_keep_their_order(router):
    logits = rows([3.0, 1.0, 3.0, 2.0, 2.0, 3.0, 0.0, 1.0])
    assert router.select_experts(logits, 5, renormalize=True).ids.tolist() == [[0, 2, 5, 3, 4]]


def test_selection_key_is_the_logit_not_the_probability(router):
    # exp(-200) and exp(-200.5) both underflow to 0 in fp32: a probability key would tie them and
    # take the lower id (1); the logit key takes expert 2 (docs/routing.md §2).
    logits = rows([0.0, -200.5, -200.0, -300.0])
    assert router.select_experts(logits, 2, renormalize=True).ids.tolist() == [[0, 2]]


# ---- R2 / R4: non-finite logits, fewer than k candidates -------------------------------------


def test_nan_and_infinities_are_never_selected(router):
    logits = rows(
        [NAN, 1.0, 2.0, 0.5, 0.0, -1.0],
        [INF, 1.0, 2.0, 0.5, 0.0, -1.0],
        [-INF, 1.0, 2.0, 0.5, 0.0, -1.0],
        [0.0, 1.0, 2.0, NAN, INF, -INF],
    )
    for scoring in ("softmax", "sigmoid"):
        result = router.select_experts(logits, 3, scoring=scoring, renormalize=True)
        assert_contract(result, 4, 3)
        assert result.ids.tolist() == [[2, 1, 3], [2, 1, 3], [2, 1, 3], [2, 1, 0]], scoring


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fewer_than_k_finite_fill_minus_one(router, scoring, renormalize):
    k, num_experts = 4, 8
    logits = torch.full((6, num_experts), NAN)
    for c, row in zip((0, 1, k - 1, k, k + 1), logits):
        row[num_experts - c :] = torch.arange(c, dtype=torch.float32)  # c finite logits at the end
    logits[5] = torch.tensor([INF, -INF, NAN, 1.0, INF, -INF, NAN, INF])  # one finite among non-finite
    result = router.select_experts(logits, k, scoring=scoring, renormalize=renormalize)
    assert_contract(result, 6, k)
    expected = [
        [-1, -1, -1, -1],
        [7, -1, -1, -1],
        [7, 6, 5, -1],
        [7, 6, 5, 4],
        [7, 6, 5, 4],
        [3, -1, -1, -1],
    ]
    assert result.ids.tolist() == expected
    assert (result.weights[result.ids >= 0] > 0).all()
    if renormalize:
        sums = result.weights.sum(dim=1)
        torch.testing.assert_close(sums[1:], torch.ones(5), rtol=0, atol=2e-6)  # fp32 rounding of a k-term sum
    assert result.weights[0].tolist() == [0.0] * k


def test_all_nan_and_all_minus_inf_rows_route_nowhere(router):
    logits = torch.stack([torch.full((8,), NAN), torch.full((8,), -INF), torch.full((8,), INF)])
    for scoring in ("softmax", "sigmoid"):
        result = router.select_experts(logits, 2, scoring=scoring, renormalize=True, num_shared_experts=1)
        assert_contract(result, 3, 3)
        assert result.ids[:, :2].tolist() == [[-1, -1]] * 3
        assert result.weights[:, :2].tolist() == [[0.0, 0.0]] * 3


# ---- docs/routing.md §2 and §3: weights -------------------------------------------------------------


def test_softmax_weights(router):
    torch.manual_seed(1)
    logits = torch.randn(5, 16) * 3
    full = torch.softmax(logits.double(), dim=1)
    top = torch.topk(logits, 4, dim=1)  # random fp32 logits: no ties
    off = router.select_experts(logits, 4, renormalize=False, routed_scaling_factor=2.5)
    on = router.select_experts(logits, 4, renormalize=True, routed_scaling_factor=2.5)
    assert off.ids.tolist() == on.ids.tolist() == top.indices.tolist()
    # fp32 softmax of 16 terms vs fp64: a few ulps of values <= 2.5
    torch.testing.assert_close(off.weights.double(), 2.5 * full.gather(1, top.indices), rtol=0, atol=2e-6)
    renormalized = torch.softmax(top.values.double(), dim=1) * 2.5
    torch.testing.assert_close(on.weights.double(), renormalized, rtol=0, atol=2e-6)


def test_grouped_weights_are_unbiased_renormalized_and_scaled(router):
    logits = rows([0.0, 2.0, -1.0, 1.0, 3.0, -2.0, 0.5, 1.5])
    bias = torch.tensor([0.0, -5.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # selection follows σ(x) + b
    kwargs = dict(scoring="sigmoid", correction_bias=bias, routed_scaling_factor=2.5)
    raw = router.select_experts(logits, 3, renormalize=False, **kwargs)
    assert raw.ids.tolist() == [[2, 4, 7]]
    s = torch.sigmoid(logits.double())[0, [2, 4, 7]]
    torch.testing.assert_close(raw.weights[0].double(), 2.5 * s, rtol=0, atol=1e-6)  # fp32 σ, a few ulps
    renorm = router.select_experts(logits, 3, renormalize=True, **kwargs)
    torch.testing.assert_close(renorm.weights[0].double(), 2.5 * s / s.sum(), rtol=0, atol=1e-6)


def test_tiny_sigmoid_sums_stay_finite(router):
    # σ(-80) ~ 1.8e-35: the selected sum is far below the 1e-20 guard, so the weights are ~0, finite.
    logits = torch.full((1, 8), -80.0)
    result = router.select_experts(logits, 2, scoring="sigmoid", renormalize=True)
    assert_contract(result, 1, 2)
    assert result.ids.tolist() == [[0, 1]]
    assert (result.weights < 1e-14).all()


def test_fp64_golden_weights():
    router = ROUTERS["reference"]  # golden weights are a reference feature
    torch.manual_seed(2)
    logits = torch.randn(6, 32).to(torch.bfloat16)
    bias = -torch.rand(32) - 1
    for kwargs in (
        dict(renormalize=False),
        dict(scoring="sigmoid", correction_bias=bias, num_expert_group=4, topk_group=2, renormalize=True),
    ):
        fp32 = router.select_experts(logits, 4, **kwargs)
        golden = router.select_experts(logits, 4, golden=True, **kwargs)
        assert golden.weights.dtype == torch.float64 and torch.equal(golden.ids, fp32.ids)
        error = (golden.weights - fp32.weights.double()).abs().max().item()
        assert 0 < error < 1e-6, error  # fp32 rounding of these formulas is ~1e-7; 0 would mean no fp64


# ---- docs/routing.md §3 grouped selection --------------------------------------------------------


def test_dropped_groups_are_minus_inf_not_zero(router):
    # 4 groups of 2; biases are < -1, so every key σ(x) + b is negative. Group 0 has the best
    # top-2 sum; a 0.0 mask would make every dropped expert (key 0.0) beat group 0's own second
    # expert, which is the sgl-project/sglang#3705 / vllm-project/vllm#13474 bug.
    logits = rows([4.0, 3.0, 0.0, 0.0, -1.0, -1.0, -2.0, -2.0])
    bias = -torch.tensor([1.1, 1.9, 1.5, 1.5, 1.2, 1.2, 1.3, 1.3])
    result = router.select_experts(
        logits, 3, scoring="sigmoid", renormalize=True, correction_bias=bias, num_expert_group=4, topk_group=1
    )
    assert result.ids.tolist() == [[0, 1, -1]]  # only group 0 kept: 2 candidates for 3 slots


def test_grouped_deepseek_v3_shape_with_negative_bias(router):
    torch.manual_seed(3)
    num_experts, groups, kept, k = 256, 8, 4, 8
    logits = torch.randn(16, num_experts)
    bias = -torch.rand(num_experts) - 1
    result = router.select_experts(
        logits,
        k,
        scoring="sigmoid",
        renormalize=True,
        correction_bias=bias,
        num_expert_group=groups,
        topk_group=kept,
        routed_scaling_factor=2.5,
    )
    assert_contract(result, 16, k)
    keys = (torch.sigmoid(logits.double()) + bias.double()).view(16, groups, -1)
    group_score = keys.topk(2, dim=-1).values.sum(-1)
    for r in range(16):
        kept_groups = set(group_score[r].topk(kept).indices.tolist())
        assert {int(e) // (num_experts // groups) for e in result.ids[r]} <= kept_groups, r
    torch.testing.assert_close(result.weights.sum(1), torch.full((16,), 2.5), rtol=0, atol=4e-6)  # 8 fp32 adds


def test_group_ties_go_to_the_lower_group_id(router):
    logits = torch.zeros(1, 8)  # every group scores the same
    for bias in (None, torch.zeros(8)):
        result = router.select_experts(
            logits, 2, scoring="sigmoid", renormalize=True, correction_bias=bias, num_expert_group=4, topk_group=2
        )
        assert result.ids.tolist() == [[0, 1]]
    # Without a bias the group score is the group max: group 1 (experts 2, 3) ties group 2.
    logits = rows([0.0, 0.0, 5.0, -9.0, 5.0, 4.0, 1.0, 1.0])
    result = router.select_experts(logits, 2, scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=1)
    assert result.ids.tolist() == [[2, 3]]


def test_group_with_fewer_than_two_candidates_scores_minus_inf(router):
    # With a bias, group 1 has one candidate (expert 2): its score is -inf, so group 0 is kept.
    logits = rows([0.0, 0.0, 9.0, NAN, -1.0, -1.0, -1.0, -1.0])
    result = router.select_experts(
        logits, 2, scoring="sigmoid", renormalize=True, correction_bias=torch.zeros(8), num_expert_group=4, topk_group=1
    )
    assert result.ids.tolist() == [[0, 1]]


def test_softmax_scored_groups_use_the_group_max(router):
    logits = rows([0.0, 5.0, 4.0, 4.0, 1.0, 1.0, 6.0, -9.0])
    result = router.select_experts(logits, 2, renormalize=True, num_expert_group=4, topk_group=2)
    assert result.ids.tolist() == [[6, 1]]  # groups 3 (max 6) and 0 (max 5) kept


# ---- docs/routing.md §4 and §5: pad rows, shared columns ----------------------------------------------


def check_pad_rows(router) -> None:
    """Rows at or past clamp(n_valid, 0, T) are -1 / 0 in every column; real rows equal an unpadded run."""
    torch.manual_seed(4)
    rows_, num_experts, k = 16, 32, 4
    clean = torch.randn(rows_, num_experts)
    for count in (0, 1, rows_ - 1, rows_, rows_ + 3, -1):
        real = min(max(count, 0), rows_)
        logits = clean.clone()
        logits[real:] = torch.where(torch.rand(rows_ - real, num_experts) < 0.5, NAN, 1e4)  # garbage
        for kwargs in (
            dict(renormalize=True, num_shared_experts=2),
            dict(
                scoring="sigmoid",
                renormalize=True,
                correction_bias=-torch.rand(num_experts) - 1,
                num_expert_group=4,
                topk_group=2,
                num_shared_experts=1,
                routed_scaling_factor=2.5,
            ),
        ):
            n_valid = torch.tensor([count], dtype=torch.int32)
            result = router.select_experts(logits, k, num_valid_rows=n_valid, **kwargs)
            width = k + kwargs["num_shared_experts"]
            assert_contract(result, rows_, width)
            assert (result.ids[real:] == -1).all(), f"n_valid={count}: pad rows routed: {result.ids[real:].tolist()}"
            assert (result.weights[real:] == 0).all(), f"n_valid={count}: pad rows weighted"
            alone = router.select_experts(clean[:real], k, **kwargs)
            assert torch.equal(result.ids[:real], alone.ids) and torch.equal(result.weights[:real], alone.weights)


def test_pad_rows_from_the_valid_row_count(router):
    check_pad_rows(router)


def test_count_tensor_shapes(router):
    logits = torch.randn(4, 8)
    for n_valid in (torch.tensor(2, dtype=torch.int32), torch.tensor([2, 99], dtype=torch.int32), torch.tensor([2])):
        ids = router.select_experts(logits, 2, renormalize=True, num_valid_rows=n_valid).ids
        assert (ids[:2] >= 0).all() and (ids[2:] == -1).all(), n_valid


@pytest.mark.parametrize("mode", ["folded", "unfolded"])
def test_shared_columns(router, mode):
    logits = rows([1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0])
    result = router.select_experts(
        logits, 2, renormalize=True, routed_scaling_factor=2.5, num_shared_experts=2, shared_weight_mode=mode
    )
    assert_contract(result, 2, 4)
    assert result.ids.tolist() == [[1, 2, 4, 5], [0, 1, 4, 5]]
    fp32_two_fifths = torch.tensor(0.4, dtype=torch.float32).item()  # fp32(1 / 2.5)
    scale, shared = (2.5, 1.0) if mode == "folded" else (1.0, fp32_two_fifths)
    assert result.weights[:, 2:].tolist() == [[shared, shared]] * 2
    assert result.weights[1, :2].tolist() == [0.5 * scale] * 2


def test_bad_configuration_is_named(router):
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match="k must lie"):
        router.select_experts(logits, 9, renormalize=True)
    with pytest.raises(ValueError, match="equal groups"):
        router.select_experts(logits, 2, scoring="sigmoid", renormalize=True, num_expert_group=3, topk_group=1)
    with pytest.raises(ValueError, match="correction_bias"):
        router.select_experts(logits, 2, renormalize=True, correction_bias=torch.zeros(8))
    with pytest.raises(ValueError, match="scoring"):
        router.select_experts(logits, 2, scoring="relu", renormalize=True)


# ---- margins (reference only) -------------------------------------------------------------------


def test_routing_margins():
    reference = ROUTERS["reference"]
    logits = rows([4.0, 3.0, 2.0, 1.0], [1.0, 1.0, 1.0, 0.0], [2.0, NAN, NAN, NAN]).to(torch.bfloat16)
    margins = reference.routing_margins(logits, 2)
    assert margins.kth_key.tolist()[:2] == [3.0, 1.0]
    assert margins.margin.tolist()[:2] == [1.0, 0.0]
    # 1.0 at magnitude 3: fp32 spacing 2**-22, bf16 spacing 2**-6.
    assert margins.margin_ulps_fp32[0].item() == 2.0**22 and margins.margin_ulps_input[0].item() == 2.0**6
    assert math.isinf(margins.margin[2].item())  # one candidate for two slots: no boundary decision
    grouped = reference.routing_margins(
        rows([0.0, 1.0, 2.0, 3.0]), 1, scoring="sigmoid", correction_bias=torch.zeros(4), num_expert_group=2, topk_group=1
    )
    s = torch.sigmoid(torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64))
    assert abs(grouped.group_margin[0].item() - float((s[2] + s[3]) - (s[0] + s[1]))) < 1e-6
    assert abs(grouped.margin[0].item() - float(s[3] - s[2])) < 1e-6

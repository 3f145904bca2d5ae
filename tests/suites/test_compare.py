"""Known-answer tests of parity.compare: each would fail if its metric or rule were wrong."""

from __future__ import annotations

import math

import pytest
import torch

from parity.compare import (
    FAIL,
    PASS,
    TIE_FLIP,
    Tolerance,
    Verdict,
    allclose_rule,
    classify_decision,
    compare,
    diff,
    dtype_spacing,
    golden_noise_rule,
    noise_floor_multiplier,
    noise_floor_rule,
    rmse,
    rounding_floor,
    ulp_distance,
)

LOOSE = Tolerance(1e-3, 0.0, "test bound")


def test_cosine_of_orthogonal_parallel_and_opposite_vectors() -> None:
    a = torch.tensor([1.0, 0.0, 2.0, 0.0])
    assert diff(a, torch.tensor([0.0, 3.0, 0.0, -1.0])).cosine == 0.0
    assert diff(a, 2 * a).cosine == pytest.approx(1.0, abs=1e-15)
    assert diff(a, -3 * a).cosine == pytest.approx(-1.0, abs=1e-15)


def test_abs_and_relative_errors_by_hand() -> None:
    ref = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    cand = torch.tensor([[1.0, 2.5], [3.0, 3.0]])
    d = diff(ref, cand, LOOSE)
    assert d.max_abs == 1.0
    assert d.mean_abs == pytest.approx(1.5 / 4)
    assert d.rel_l2 == pytest.approx(math.sqrt(0.25 + 1.0) / math.sqrt(30.0))
    assert d.n_bad == 2 and d.first_bad_index == (0, 1) and d.first_bad_row == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_ulp_distance_of_adjacent_numbers_is_one(dtype: torch.dtype) -> None:
    values = torch.tensor([1.0, -1.0, 1e-3, -250.0, 0.0], dtype=dtype)
    up = torch.nextafter(values, torch.full_like(values, math.inf))
    assert ulp_distance(values, up).tolist() == [1] * 5
    two_up = torch.nextafter(up, torch.full_like(up, math.inf))
    assert ulp_distance(values, two_up).tolist() == [2] * 5


def test_ulp_distance_treats_signed_zeros_as_equal_and_counts_across_zero() -> None:
    zeros = torch.tensor([0.0], dtype=torch.bfloat16)
    assert int(ulp_distance(zeros, -zeros)[0]) == 0
    tiny = torch.nextafter(zeros, torch.tensor([1.0], dtype=torch.bfloat16))
    assert int(ulp_distance(-tiny, tiny)[0]) == 2


def test_ulp_distance_is_measured_in_the_candidate_dtype() -> None:
    ref = torch.tensor([1.0], dtype=torch.float32)
    cand = torch.tensor([1.0078125], dtype=torch.bfloat16)  # next bf16 after 1.0
    assert int(ulp_distance(ref, cand)[0]) == 1
    assert diff(ref, cand).max_ulp == 1


def test_first_bad_index_and_row_in_a_3d_tensor() -> None:
    ref = torch.zeros(2, 3, 4)
    cand = ref.clone()
    cand[1, 2, 3] = 1.0
    cand[1, 2, 0] = 0.5
    d = diff(ref, cand, LOOSE)
    assert d.first_bad_index == (1, 2, 0)
    assert d.first_bad_row == 1 * 3 + 2
    assert d.n_bad == 2


def test_within_tolerance_has_no_bad_index() -> None:
    ref = torch.linspace(-1, 1, 50)
    d = diff(ref, ref + 5e-4, LOOSE)
    assert d.ok and d.first_bad_index is None and d.verdict().verdict == PASS


def test_rtol_scales_with_the_reference_magnitude() -> None:
    tol = Tolerance(0.0, 1e-2, "test bound")
    assert diff(torch.tensor([100.0]), torch.tensor([100.9]), tol).ok
    assert not diff(torch.tensor([1.0]), torch.tensor([1.02]), tol).ok


def test_argmax_and_topk_agreement() -> None:
    ref = torch.tensor([[0.1, 0.9, 0.0], [0.5, 0.2, 0.3], [0.3, 0.3, 0.4]])
    cand = torch.tensor([[0.1, 0.9, 0.0], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]])
    d = diff(ref, cand, LOOSE, topk=2)
    assert d.argmax_agree == pytest.approx(2 / 3)
    assert d.topk_agree == pytest.approx(2 / 3)  # row 1: {0,2} vs {1,2}


def test_nan_in_candidate_is_a_fail_verdict_not_an_exception() -> None:
    ref = torch.ones(4)
    cand = torch.tensor([1.0, math.nan, 1.0, math.inf])
    verdict = allclose_rule(ref, cand, LOOSE)
    assert verdict.verdict == FAIL and "non-finite" in verdict.detail
    d = diff(ref, cand, LOOSE)
    assert d.nonfinite_cand == 2 and d.nonfinite_mismatch == 2 and d.first_bad_index == (1,)


def test_equal_infinities_match_but_nan_only_when_asked() -> None:
    ref = torch.tensor([0.0, -math.inf, math.nan])
    assert not diff(ref, ref.clone(), LOOSE).ok
    assert diff(ref, ref.clone(), LOOSE, equal_nan=True).ok
    masked = torch.tensor([0.5, -math.inf])
    assert diff(masked, masked.clone(), LOOSE).ok


def test_nested_outputs_report_the_first_diverging_layer() -> None:
    layers = [torch.full((2, 3), float(i)) for i in range(5)]
    drifted = [t.clone() for t in layers]
    drifted[2][1, 0] += 0.1
    drifted[4] += 1.0
    tree = compare(
        {"hidden_states": layers, "logits": torch.zeros(2)}, {"hidden_states": drifted, "logits": torch.zeros(2)}, LOOSE
    )
    first = tree.first_failing()
    assert first is not None and first.name == "['hidden_states'][2]" and first.first_bad_row == 1
    verdict = tree.verdict()
    assert verdict.verdict == FAIL and "first diverging: ['hidden_states'][2]" in verdict.detail


def test_structure_mismatch_is_a_fail_verdict() -> None:
    tree = compare([torch.zeros(2), torch.zeros(2)], [torch.zeros(2)], LOOSE)
    assert tree.verdict().verdict == FAIL and "missing in candidate" in tree.verdict().detail
    tree = compare({"a": torch.zeros(2)}, {"a": torch.zeros(3)}, LOOSE)
    assert "shape (2,) vs (3,)" in tree.verdict().detail


def _noisy(golden: torch.Tensor, sigma: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (golden + sigma * torch.randn(golden.shape, generator=g, dtype=torch.float64)).float()


def test_noise_floor_rule_passes_within_the_multiplier_and_fails_beyond() -> None:
    golden = torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    eager = _noisy(golden, 1e-3, 1)
    tol = Tolerance(1e-6, 1e-6, "tight pre-check so the noise-floor branch decides")
    ok, rec = noise_floor_rule(golden, eager, _noisy(golden, 1.5e-3, 2), tol)
    assert ok.verdict == PASS and rec.multiplier == 2.0 and not rec.allclose
    assert rec.ref_error == pytest.approx(1e-3, rel=0.05) and rec.ratio == pytest.approx(1.5, rel=0.1)
    bad, rec = noise_floor_rule(golden, eager, _noisy(golden, 3e-3, 3), tol)
    assert bad.verdict == FAIL and bad.threshold == pytest.approx(2 * rec.ref_error + 1e-7)
    assert ok.bound == bad.bound == "measured"  # the threshold is this run's noise, not a policy


def test_golden_noise_rule_measures_every_term_of_its_bound() -> None:
    golden = torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    eager = _noisy(golden, 1e-3, 1)
    ok, rec = golden_noise_rule(golden, eager, _noisy(golden, 1.5e-3, 2))
    assert ok.verdict == PASS and ok.bound == "measured" and rec.multiplier == 2.0 and not rec.allclose
    # the floor is the golden's own rounding to fp32 (about 2^-24 of |x|/sqrt(3)), no atol in it
    assert rec.floor == pytest.approx(rounding_floor(golden, torch.float32)) and 1e-9 < rec.floor < 1e-7
    assert ok.threshold == pytest.approx(2 * rec.ref_error + rec.floor)
    bad, _ = golden_noise_rule(golden, eager, _noisy(golden, 3e-3, 3))
    assert bad.verdict == FAIL and "above noise floor" in bad.detail


def test_golden_noise_rule_has_no_precheck_and_no_fixed_floor() -> None:
    """The weakness of the fixed pre-check and floor on bf16 logits of |x| ~ 0.5 (the tiny model):
    a defect several times the noise passes `noise_floor_rule` at atol = rtol = 1e-2 and fails here."""
    golden = 0.5 * torch.randn(2560, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    eager = golden.to(torch.bfloat16)  # a faithful bf16 reference: rounding only
    shifted = (golden + 4e-3).to(torch.bfloat16)  # every logit off by about one bf16 spacing at 0.5
    hf_bound = Tolerance(1e-2, 1e-2, "the HF bf16 pair, as the former noise_floor_bf16")
    weak, weak_rec = noise_floor_rule(golden, eager, shifted, hf_bound)
    assert weak.verdict == PASS and weak_rec.allclose  # the pre-check let it through
    strict, rec = golden_noise_rule(golden, eager, shifted)
    assert strict.verdict == FAIL and rec.ratio > 3
    assert rec.floor == pytest.approx(rec.ref_error)  # the reference is the golden rounded: error = floor
    same, _ = golden_noise_rule(golden, eager, eager.clone())
    assert same.verdict == PASS  # the reference itself passes: its error is within m x itself + floor


def test_golden_noise_rule_on_an_exact_reference_still_allows_rounding() -> None:
    """Where the reference equals the golden (exact values), the floor is the dtype's rounding."""
    golden = torch.arange(1, 65, dtype=torch.float64) / 3.0
    exact = golden.float()
    verdict, rec = golden_noise_rule(golden, golden, exact)
    assert rec.ref_error == 0.0 and verdict.verdict == PASS and rec.floor > 0
    nudged = torch.nextafter(exact, torch.full_like(exact, math.inf))
    assert golden_noise_rule(golden, golden, nudged)[0].verdict == FAIL  # one more rounding than storing needs


def test_golden_noise_rule_non_finite_candidate_fails_with_reason() -> None:
    golden = torch.ones(8, dtype=torch.float64)
    cand = torch.ones(8)
    cand[2] = math.inf
    verdict, _ = golden_noise_rule(golden, torch.ones(8), cand)
    assert verdict.verdict == FAIL and "non-finite" in verdict.detail


def test_a_verdicts_bound_is_fixed_with_a_threshold_and_empty_without() -> None:
    assert Verdict(PASS, "max_abs", 1e-7, 1e-5).bound == "fixed"
    assert Verdict(PASS, "assertion", math.nan, None).bound == ""
    assert Verdict(PASS, "rmse_vs_golden", 1e-7, 2e-7, bound="measured").bound == "measured"
    with pytest.raises(ValueError, match="bound must be one of"):
        Verdict(PASS, "m", 0.0, 1.0, bound="guessed")


def test_noise_floor_rule_uses_three_for_half_precision_and_small_tensors() -> None:
    assert noise_floor_multiplier(torch.bfloat16, 10**6) == 3.0
    assert noise_floor_multiplier(torch.float16, 10**6) == 3.0
    assert noise_floor_multiplier(torch.float32, 999) == 3.0
    assert noise_floor_multiplier(torch.float32, 1000) == 2.0


def test_noise_floor_rule_non_finite_candidate_fails_with_reason() -> None:
    golden = torch.zeros(8, dtype=torch.float64)
    cand = torch.zeros(8)
    cand[3] = math.nan
    verdict, _ = noise_floor_rule(golden, torch.zeros(8), cand, LOOSE)
    assert verdict.verdict == FAIL and "non-finite" in verdict.detail


def test_rmse_by_hand() -> None:
    assert rmse(torch.tensor([0.0, 0.0]), torch.tensor([3.0, 4.0])) == pytest.approx(math.sqrt(12.5))


def test_tolerance_needs_a_reason_and_verdicts_are_validated() -> None:
    with pytest.raises(ValueError, match="reason"):
        Tolerance(1e-5, 1e-5, "  ")
    with pytest.raises(ValueError, match="verdict"):
        Verdict("maybe", "m", 0.0, None)


def test_spacing_and_tie_classification_scale_with_magnitude() -> None:
    assert float(dtype_spacing(1.0, torch.bfloat16)) == 2**-7
    assert float(dtype_spacing(20.0, torch.bfloat16)) == 0.125
    assert classify_decision(0.2, 20.0, torch.bfloat16) == TIE_FLIP
    assert classify_decision(0.2, 1.0, torch.bfloat16) == FAIL

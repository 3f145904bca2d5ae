"""The scalar verdict rules every suite writes its rows through: each passes where its policy holds,
goes red where it does not, and keeps value, threshold and verdict consistent."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from parity.compare import (
    AT_LEAST,
    AT_MOST,
    BETTER,
    EXACTLY,
    FAIL,
    FIXED,
    MEASURED,
    PASS,
    count_rule,
    equality_rule,
    flag_rule,
    threshold_rule,
)


@pytest.mark.parametrize(
    ("value", "threshold", "at", "verdict"),
    [
        (0, 0, AT_MOST, PASS),
        (1, 0, AT_MOST, FAIL),  # one mismatched token where none is allowed
        (3, 1, AT_LEAST, PASS),
        (0, 1, AT_LEAST, FAIL),  # no module compiled: regional compile silently skipped
        (2, 2, EXACTLY, PASS),
        (3, 2, EXACTLY, FAIL),  # one compile more than the warm-up expects
        (1, 2, EXACTLY, FAIL),
    ],
)
def test_count_rule(value: int, threshold: int, at: str, verdict: str) -> None:
    result = count_rule(value, threshold, metric="m", at=at, detail="why")
    assert (result.verdict, result.metric, result.value, result.threshold, result.detail, result.bound) == (
        verdict,
        "m",
        value,
        threshold,
        "why",
        FIXED,
    )


def test_count_rule_refuses_what_is_not_a_count() -> None:
    with pytest.raises(TypeError, match="int count"):
        count_rule(0.5, 0, metric="m")
    with pytest.raises(TypeError, match="int count"):
        count_rule(True, 1, metric="m")  # a yes/no answer belongs in flag_rule
    with pytest.raises(ValueError, match="at must be one of"):
        count_rule(0, 0, metric="m", at="below")


def test_count_rule_takes_numpy_and_torch_integers() -> None:
    assert count_rule(np.int64(0), 0, metric="m").verdict == PASS
    assert count_rule(int(torch.tensor(2)), 1, metric="m", at=AT_MOST).verdict == FAIL


@pytest.mark.parametrize(
    ("value", "threshold", "at", "verdict"),
    [
        (1e-6, 1e-5, AT_MOST, PASS),
        (1e-5, 1e-5, AT_MOST, PASS),  # inclusive
        (2e-5, 1e-5, AT_MOST, FAIL),
        (31.0, 30.0, AT_LEAST, PASS),
        (30.0, 30.0, AT_LEAST, PASS),
        (29.9, 30.0, AT_LEAST, FAIL),  # PSNR below its bound
        (math.inf, 30.0, AT_LEAST, PASS),  # identical images
        (math.inf, 1.0, AT_MOST, FAIL),
    ],
)
def test_threshold_rule(value: float, threshold: float, at: str, verdict: str) -> None:
    result = threshold_rule(value, threshold, metric="m", at=at)
    assert (result.verdict, result.value, result.threshold, result.bound) == (verdict, value, threshold, FIXED)


def test_threshold_rule_fails_nan_and_says_so() -> None:
    for value, threshold in ((math.nan, 1.0), (0.5, math.nan)):
        for at in (AT_MOST, AT_LEAST):
            result = threshold_rule(value, threshold, metric="psnr", at=at, detail="pair a vs b")
            assert result.verdict == FAIL and result.detail.startswith("non-finite") and "pair a vs b" in result.detail


def test_threshold_rule_carries_a_measured_bound_and_refuses_exactly() -> None:
    assert threshold_rule(40.0, 38.5, metric="psnr_vs_golden", at=AT_LEAST, bound=MEASURED).bound == MEASURED
    with pytest.raises(ValueError, match="counts"):
        threshold_rule(1.0, 1.0, metric="m", at=EXACTLY)
    with pytest.raises(ValueError, match="bound must be"):
        threshold_rule(1.0, 1.0, metric="m", bound="")


def test_flag_rule() -> None:
    yes, no = flag_rule(True, metric="capture_refused"), flag_rule(False, metric="capture_refused")
    assert (yes.verdict, yes.value, yes.threshold) == (PASS, 1, 1)
    assert (no.verdict, no.value, no.threshold) == (FAIL, 0, 1)
    assert flag_rule(torch.tensor(True), metric="m").verdict == PASS
    assert flag_rule(np.bool_(False), metric="m").verdict == FAIL
    # the number the property was read from, shown instead of 1 / 0
    both = flag_rule(False, metric="gen_expert_calls", value=3, detail="und calls 0")
    assert (both.verdict, both.value, both.threshold) == (FAIL, 3, 1)


def test_flag_rule_refuses_counts_and_text() -> None:
    for not_a_flag in (0, 2, 0.0, "yes"):
        with pytest.raises(TypeError, match="must be a bool"):
            flag_rule(not_a_flag, metric="m")


def test_equality_rule() -> None:
    same = equality_rule([1, 2], [1, 2], metric="moe_layers_match", detail="moe_type 'ffn-1:3'")
    assert (same.verdict, same.value, same.threshold) == (PASS, 1, 1)
    assert same.detail == "moe_type 'ffn-1:3': got [1, 2], expected [1, 2]"
    shifted = equality_rule([2, 3], [1, 2], metric="moe_layers_match")  # a range read shifted by one
    assert (shifted.verdict, shifted.value) == (FAIL, 0) and "got [2, 3], expected [1, 2]" in shifted.detail


def test_better_names_a_direction_per_rule() -> None:
    assert BETTER == {AT_MOST: "lower", AT_LEAST: "higher", EXACTLY: "equal"}

"""The checks that replaced bitwise forward comparisons (tests/support/noise_checks.py) can fail: a state
that differs in one bit, a name, a dtype or a shape; a forward off by more than the noise floor; a
greedy decode that flips a token the measured noise does not explain."""

from __future__ import annotations

import types

import pytest
import torch

from parity.compare import Tolerance
from tests.support.dit_support import latents, tiny_pair, tiny_state
from tests.support.noise_checks import (
    adapter_state,
    assert_same_greedy,
    assert_same_state,
    assert_within_noise_floor,
    routing_tie_flips,
    state_differences,
)

TOL = Tolerance(1e-5, 1e-5, "test bound: fp32 accumulation order")


def test_state_differences_sees_one_bit_a_name_a_dtype_and_a_shape() -> None:
    state = {name: value.clone() for name, value in tiny_state().items()}
    assert state_differences(state, tiny_state()) == []
    name = "layers.0.attn.to_q.weight"
    one_ulp = dict(state)
    one_ulp[name] = state[name].clone()
    one_ulp[name][3, 5] = torch.nextafter(one_ulp[name][3, 5], torch.tensor(float("inf")))
    assert state_differences(state, one_ulp) == [f"{name}: 1/{state[name].numel()} values differ bitwise, first at (3, 5)"]
    signed_zero = {"z": torch.zeros(3)}
    assert state_differences(signed_zero, {"z": -torch.zeros(3)}) == [
        "z: 3/3 values differ bitwise, first at (0,)"
    ]  # torch.equal says equal
    missing = {k: v for k, v in state.items() if k != name}
    assert state_differences(state, missing) == [f"{name}: only in the first state"]
    assert state_differences(state, {**state, name: state[name].double()}) == [f"{name}: dtype torch.float32 vs torch.float64"]
    assert state_differences(state, {**state, name: state[name][:-1]})[0].startswith(f"{name}: shape")


def test_assert_same_state_compares_module_and_decoder() -> None:
    reference, serving = tiny_pair()
    assert {k.split(".")[0] for k in adapter_state(serving)} == {"module", "decoder"}
    other_reference, _ = tiny_pair()
    assert_same_state(reference, other_reference)
    perturbed = {k: v.clone() for k, v in tiny_state().items()}
    perturbed["vae_decoder.conv_out.bias"][0] += 1e-3
    changed = type(reference).build(reference.config, perturbed)
    with pytest.raises(AssertionError, match=r"decoder\.conv_out\.bias: 1/3 values differ bitwise"):
        assert_same_state(reference, changed)


def test_noise_floor_forward_check_passes_rounding_and_catches_a_changed_weight() -> None:
    reference, _ = tiny_pair()
    golden, _ = tiny_pair(torch.float64)
    x, t = latents((1, 16, 16, 16)), torch.tensor([0.5])
    text, mask = reference.text_condition(3, seed=0)
    want = golden.forward(x.double(), t.double(), text.double(), mask)
    eager = reference.forward(x, t, text, mask)
    rounded = (eager.double() + 1e-7 * torch.randn_like(eager, dtype=torch.float64)).float()  # accumulation-order noise
    assert_within_noise_floor(want, eager, rounded, TOL)
    perturbed = {k: v.clone() for k, v in tiny_state().items()}
    perturbed["layers.1.norm1.linear.weight"] *= 1.01  # a 1% scaled modulation: a loader that mangles one tensor
    wrong = type(reference).build(reference.config, perturbed).forward(x, t, text, mask)
    with pytest.raises(AssertionError, match="above noise floor"):
        assert_within_noise_floor(want, eager, wrong, TOL)


def _greedy(logits: torch.Tensor) -> types.SimpleNamespace:
    return types.SimpleNamespace(tokens=logits.argmax(-1), step_logits=logits)


def test_same_greedy_accepts_a_tie_flip_and_stops_comparing_there() -> None:
    logits = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    logits[1, 2, 3] = logits[1, 2].max() + 1.0  # row 1, step 2: token 3 by a clear margin...
    logits[1, 2, 7] = logits[1, 2, 3] - 2e-7  # ...and token 7 just behind it: a near tie
    want = _greedy(logits)
    assert assert_same_greedy(want, _greedy(logits.clone())) is None
    flipped = logits.clone()
    flipped[1, 2, 7] += 4e-7  # 4e-7 of rounding on one logit turns the tie over
    flipped[:, 3:] = torch.randn(2, 2, 16)  # after the flip the sequences diverge: not compared
    assert assert_same_greedy(want, _greedy(flipped)) == 2


def test_same_greedy_catches_a_flip_the_noise_does_not_explain_and_drifting_logits() -> None:
    logits = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    want = _greedy(logits)
    wrong_token = types.SimpleNamespace(tokens=want.tokens.clone(), step_logits=logits.clone())
    second = logits[0, 1].topk(2).indices[1]
    wrong_token.tokens[0, 1] = second  # a decoder that does not take the argmax: margin >> noise (0)
    with pytest.raises(AssertionError, match="not a tie flip"):
        assert_same_greedy(want, wrong_token)
    drifted = logits.clone()
    drifted[:, 1:] += 1e-3  # logits off by far more than fp32 noise, tokens unchanged
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_same_greedy(want, _greedy(drifted))


def test_routing_tie_flips_accepts_a_near_tie_and_refuses_a_wide_margin() -> None:
    want = torch.tensor([[0]], dtype=torch.int32)
    other = torch.tensor([[1]], dtype=torch.int32)
    near = torch.tensor([[3.0, 3.0, -1.0, 0.5]])
    near[0, 1] = torch.nextafter(near[0, 0], torch.tensor(0.0))  # one fp32 ulp below the winner
    assert routing_tie_flips(near, want, other, 1, {"scoring": "softmax"}) == [0]
    wide = torch.tensor([[3.0, 1.0, -1.0, 0.5]])
    with pytest.raises(AssertionError, match="differ outside the noise"):
        routing_tie_flips(wide, want, other, 1, {"scoring": "softmax"})
    assert routing_tie_flips(wide, want, want.clone(), 1, {"scoring": "softmax"}) == []

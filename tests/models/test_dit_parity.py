"""Serving vs reference DiT: velocity, block by block, dtypes, and the empty-text skip."""

from __future__ import annotations

import types

import pytest
import torch

from tests.support.dit_support import latents, record_block_outputs, tiny_pair

# fp32: the two implementations sum in different orders (the serving joint sequence is
# [text slots, image] through SDPA, the reference [text, image, tail padding] through einsum and
# softmax), so they agree to a few fp32 ulps of the O(1) velocity, not bitwise.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
# fp64: the same reorderings at fp64 epsilon (2.2e-16) over O(1e3)-term sums.
FP64_TOL = dict(atol=1e-12, rtol=1e-12)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.mark.parametrize("text_len", [0, 1, 4, 77])
@pytest.mark.parametrize("size", [(32, 32), (32, 64), (48, 48)])
def test_velocity_matches_reference(pair, text_len, size):
    reference, serving = pair
    text, mask = serving.text_condition(text_len, seed=text_len)
    x, t = latents((1, 16, *size)), torch.tensor([0.37])
    expected = reference.forward(x, t, text, mask)
    assert expected.shape == (1, 16, *size) and expected.abs().max() > 0.1
    torch.testing.assert_close(serving.forward(x, t, text, mask), expected, **FP32_TOL)


def test_padded_batch_matches_reference(pair):
    """Two samples of different text lengths in one batch: the key-padding mask path."""
    reference, serving = pair
    text, mask = serving.text_condition(9, seed=5, batch=2)
    mask[1, 3:] = False
    x, t = latents((2, 16, 32, 48)), torch.tensor([0.2, 0.9])
    expected = reference.forward(x, t, text, mask)
    torch.testing.assert_close(serving.forward(x, t, text, mask), expected, **FP32_TOL)
    # Padding is really masked: garbage in the padded text slots changes nothing.
    garbage = text.clone()
    garbage[1, 3:] = 1e3
    torch.testing.assert_close(serving.forward(x, t, garbage, mask), expected, **FP32_TOL)
    torch.testing.assert_close(reference.forward(x, t, garbage, mask), expected, **FP32_TOL)


def test_fp64_matches_reference_tightly():
    reference, serving = tiny_pair(torch.float64)
    text, mask = serving.text_condition(77, seed=2)
    x, t = latents((1, 16, 32, 32)).double(), torch.tensor([0.6], dtype=torch.float64)
    expected = reference.forward(x, t, text, mask)
    assert expected.dtype == torch.float64
    torch.testing.assert_close(serving.forward(x, t, text, mask), expected, **FP64_TOL)


def test_bf16_error_matches_the_reference_against_the_fp64_golden():
    """Noise-floor rule: the serving bf16 error against fp64 is no worse than the reference's."""
    text_f, mask = tiny_pair()[1].text_condition(77, seed=4)
    x, t = latents((1, 16, 32, 32)), torch.tensor([0.5])
    golden = tiny_pair(torch.float64)[0].forward(x.double(), t.double(), text_f.double(), mask)
    reference, serving = tiny_pair(torch.bfloat16)
    err_ref = (reference.forward(x, t, text_f, mask).double() - golden).pow(2).mean().sqrt()
    err_srv = (serving.forward(x, t, text_f, mask).double() - golden).pow(2).mean().sqrt()
    assert 0 < err_ref < 0.05 and 0 < err_srv < 0.05
    # 1.5x: two bf16 implementations with different op orders land within each other's noise.
    assert err_srv < 1.5 * err_ref


def test_block_sites_have_the_same_names_in_execution_order(pair):
    reference, serving = pair
    names = [name for name, _ in serving.block_sites()]
    assert names == [name for name, _ in reference.block_sites()]
    assert names == ["context_refiner.0", "noise_refiner.0", "layers.0", "layers.1"]


def test_block_outputs_match_block_by_block(pair):
    """Batch 1 without padding: both joint sequences are [text, image], so every site compares."""
    reference, serving = pair
    text, mask = serving.text_condition(4, seed=8)
    x, t = latents((1, 16, 32, 32)), torch.tensor([0.25])
    ref_out, ref_handles = record_block_outputs(reference)
    srv_out, srv_handles = record_block_outputs(serving)
    try:
        reference.forward(x, t, text, mask)
        serving.forward(x, t, text, mask)
    finally:
        for h in ref_handles + srv_handles:
            h.remove()
    for name, _ in serving.block_sites():
        assert len(ref_out[name]) == len(srv_out[name]) == 1, name
        torch.testing.assert_close(srv_out[name][0], ref_out[name][0], **FP32_TOL, msg=lambda m, n=name: f"{n}: {m}")
    # The blocks do real work (adaLN and norm_out are not zero-initialised).
    assert (ref_out["layers.1"][0] - ref_out["layers.0"][0]).abs().max() > 0.1


def _calls_of_context_refiner(adapter, text_len: int) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    handle = adapter.module.context_refiner[0].register_forward_pre_hook(lambda _m, args: shapes.append(tuple(args[0].shape)))
    try:
        text, mask = adapter.text_condition(text_len, seed=1)
        out = adapter.forward(latents((1, 16, 32, 32)), torch.tensor([0.5]), text, mask)
        assert torch.isfinite(out).all()
    finally:
        handle.remove()
    return shapes


def test_empty_text_runs_and_skips_the_context_refiner(pair):
    reference, serving = pair
    assert _calls_of_context_refiner(serving, 0) == []
    assert _calls_of_context_refiner(serving, 4) == [(1, 4, 96)]
    # The reference runs upstream's loop on the empty text (an empty tensor in, empty out).
    assert _calls_of_context_refiner(reference, 0) == [(1, 0, 96)]


def test_the_skip_check_catches_a_port_without_the_skip():
    """Mutant from the sensitivity catalogue: `_apply_refiners` runs the refiner on empty text."""
    _, serving = tiny_pair()

    def no_skip(self, text, text_mask, text_rope, img, img_mask, img_rope, temb):
        for layer in self.context_refiner:
            text = layer(text, text_mask, text_rope)
        for layer in self.noise_refiner:
            img = layer(img, img_mask, img_rope, temb)
        return text, img

    serving.module._apply_refiners = types.MethodType(no_skip, serving.module)
    assert _calls_of_context_refiner(serving, 0) == [(1, 0, 96)]

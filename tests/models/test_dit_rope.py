"""3-axis interleaved RoPE: position ids, the pair rotation by hand, table vs direct equality."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from reference_models.dit.config import tiny_config
from reference_models.dit.model import RotaryPosEmbed, apply_rotary_interleaved
from serving_models.dit.adapter import ServingDiT
from serving_models.dit.config import DiTConfig as ServingDiTConfig
from serving_models.dit.model import RotaryEmbedding3D, image_position_ids, rotate_interleaved, text_position_ids
from tests.support.dit_support import latents, tiny_pair, tiny_state


def test_reference_position_ids_text_diagonal_then_image_grid():
    ids = RotaryPosEmbed.position_ids([3, 0], (2, 3), torch.device("cpu"))
    assert ids.shape == (2, 3 + 6, 3)
    assert ids[0, :3].tolist() == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    grid = [[r, c] for r in range(2) for c in range(3)]
    assert ids[0, 3:].tolist() == [[3, r, c] for r, c in grid]
    # No text: image tokens start the sequence with t = cap_len = 0; the tail is padding.
    assert ids[1, :6].tolist() == [[0, r, c] for r, c in grid]
    assert ids[1, 6:].tolist() == [[0, 0, 0]] * 3


def test_serving_position_ids_use_the_device_side_caption_length():
    mask = torch.tensor([[True, True, False, False]])  # left-packed, cap_len 2, 2 padding slots
    assert text_position_ids(mask)[0].tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]  # padding at 0, as upstream
    img = image_position_ids(mask, 2, 3)[0].tolist()
    assert img == [[2, r, c] for r in range(2) for c in range(3)]
    assert image_position_ids(mask[:, :0], 1, 2)[0].tolist() == [[0, 0, 0], [0, 0, 1]]


def _hand_rotation(x: list[float], pos: tuple[int, int, int], axes: tuple[int, ...], theta: float) -> list[float]:
    """Interleaved pairs (2j, 2j+1); pair j belongs to axis a with local index i, angle
    pos[a] * theta^(-2i/axes[a]); axes are concatenated t|h|w along head_dim."""
    out = []
    for axis, dim in enumerate(axes):
        offset = sum(axes[:axis])
        for i in range(dim // 2):
            a = pos[axis] * theta ** (-2 * i / dim)
            x1, x2 = x[offset + 2 * i], x[offset + 2 * i + 1]
            out += [x1 * math.cos(a) - x2 * math.sin(a), x1 * math.sin(a) + x2 * math.cos(a)]
    return out


def _rotate_half_wrong(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The Qwen-style rotate-half pairing (i with i + d/2): the classic porting mistake."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    c = torch.cat([cos[..., 0::2], cos[..., 0::2]], dim=-1)[:, :, None]
    s = torch.cat([sin[..., 0::2], sin[..., 0::2]], dim=-1)[:, :, None]
    return x * c + rotated * s


@pytest.mark.parametrize("impl", ["reference", "serving"])
def test_interleaved_rotation_equals_hand_computation(impl):
    config = tiny_config()
    x = torch.arange(1.0, 25.0, dtype=torch.float64).reshape(1, 1, 1, 24) / 10
    pos = (3, 5, 7)
    ids = torch.tensor([[pos]])
    if impl == "reference":
        cos, sin = RotaryPosEmbed(config)(ids, torch.float64)
        got = apply_rotary_interleaved(x, cos, sin)
    else:
        cos, sin = RotaryEmbedding3D(ServingDiTConfig.coerce(config))(ids, torch.float64)
        got = rotate_interleaved(x, cos, sin)
    expected = _hand_rotation(x.flatten().tolist(), pos, config.axes_dim_rope, config.rope_theta)
    # fp64 against Python floats: only the last bits of cos/sin differ.
    torch.testing.assert_close(got.flatten(), torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=1e-12)
    # Pair 0 by hand: (x0, x1) = (0.1, 0.2) rotated by angle t = 3.
    assert got.flatten()[0].item() == pytest.approx(0.1 * math.cos(3) - 0.2 * math.sin(3), abs=1e-14)
    # The rotate-half pairing gives a different answer: the check can fail.
    wrong = _rotate_half_wrong(x, cos, sin).flatten()
    assert (wrong - torch.tensor(expected, dtype=torch.float64)).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_tables_and_serving_direct_angles_agree_bitwise(dtype):
    """Upstream gathers from fp64-built tables cast to fp32; serving computes the same fp64
    products pos·inv_freq directly, so the values must be identical, not merely close."""
    config = tiny_config()
    ids = RotaryPosEmbed.position_ids([5, 77], (16, 32), torch.device("cpu"))
    ref = RotaryPosEmbed(config)(ids, dtype)
    srv = RotaryEmbedding3D(ServingDiTConfig.coerce(config))(ids, dtype)
    # Bitwise holds by construction: the angles are the same fp64 products on both sides, and cos /
    # sin give one angle the same bits wherever it sits in a tensor (the test below guards that).
    assert torch.equal(ref[0], srv[0]) and torch.equal(ref[1], srv[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cos_and_sin_bits_do_not_depend_on_position(dtype):
    """The premise of the bitwise RoPE comparison above: the reference takes cos / sin of a table
    and serving of gathered angles, so one angle sits at different positions of differently shaped
    tensors. ATen's own vectorized kernels may round a tensor's vector body and its scalar tail
    differently (torch.sigmoid does; the router avoids it for that reason); cos and sin must not,
    under any kernel set (checked here on the one this process runs: docs/cpu-kernels.md)."""
    angles = (torch.rand(4099, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 400).to(dtype)
    for fn in (torch.cos, torch.sin):
        assert _positions_that_round_differently(fn, angles) == 0, fn.__name__

    def last_element_rounds_up(x: torch.Tensor) -> torch.Tensor:  # a kernel whose tail rounds its own way
        out = torch.cos(x)
        out[-1] = torch.nextafter(out[-1], torch.tensor(math.inf, dtype=out.dtype))
        return out

    assert _positions_that_round_differently(last_element_rounds_up, angles) == angles.numel() - 1


def _positions_that_round_differently(fn, values: torch.Tensor) -> int:
    """How many values get other bits from `fn` on the whole tensor than from `fn` alone."""
    one_by_one = torch.cat([fn(values[i : i + 1]) for i in range(values.numel())])
    return int((fn(values) != one_by_one).sum())


def test_reference_rejects_positions_outside_axes_lens():
    config = dataclasses.replace(tiny_config(), axes_lens=(8, 128, 128))
    ids = RotaryPosEmbed.position_ids([8], (2, 2), torch.device("cpu"))
    with pytest.raises(ValueError, match="RoPE position 8 on axis t is outside axes_lens\\[0\\] = 8"):
        RotaryPosEmbed(config)(ids, torch.float32)


def test_serving_rejects_real_text_longer_than_axes_lens():
    """129 real tokens do not fit a 128-row table; the padded length alone is no bound (docs/model.md §7)."""
    _, serving = tiny_pair()
    states = torch.zeros(1, 129, 64)
    with pytest.raises(RuntimeError, match="real text length of 128 tokens or more reaches the RoPE tables' end"):
        serving.forward(latents((1, 16, 8, 8)), torch.tensor([0.5]), states, torch.ones(1, 129, dtype=torch.bool))


def test_serving_rejects_a_grid_past_axes_lens():
    _, serving = tiny_pair()
    states, mask = torch.zeros(1, 4, 64), torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="token grid 130x4 exceeds axes_lens"):
        serving.forward(latents((1, 16, 260, 8)), torch.tensor([0.5]), states, mask)


def test_both_refuse_128_real_tokens_at_axes_lens_128():
    """128 real tokens put the image tokens at t = 128, outside the 128-row table: both refuse."""
    reference, serving = tiny_pair()
    states, mask = torch.zeros(1, 128, 64), torch.ones(1, 128, dtype=torch.bool)
    inputs = (latents((1, 16, 8, 8)), torch.tensor([0.5]), states, mask)
    with pytest.raises(RuntimeError, match="real text length of 128 tokens or more reaches the RoPE tables' end"):
        serving.forward(*inputs)
    with pytest.raises(ValueError, match="RoPE position 128 on axis t is outside axes_lens\\[0\\] = 128"):
        reference.forward(*inputs)


def boundary_inputs() -> tuple[torch.Tensor, ...]:
    """Text length 128 (= axes_lens[0] of the tiny config) with 127 real tokens in row 0 and 5 in
    row 1: the positions stay inside the tables, upstream and the reference accept it."""
    states, mask = tiny_pair()[1].text_condition(128, seed=5, batch=2)
    mask[0, 127:] = False
    mask[1, 5:] = False
    return latents((2, 16, 8, 8)), torch.tensor([0.5, 0.5]), states, mask


def test_serving_accepts_text_length_128_with_127_real_tokens():
    reference, serving = tiny_pair()
    assert serving.config.axes_lens[0] == 128
    inputs = boundary_inputs()
    # fp32 summation-order noise of the two implementations (cases/dit.toml, serving_vs_reference_fp32)
    torch.testing.assert_close(serving.forward(*inputs), reference.forward(*inputs), atol=1e-5, rtol=1e-5)


def test_boundary_test_fails_with_the_padded_length_check(monkeypatch):
    """The defect this replaces: the check bounded the padded length (`L >= axes_lens[0]` refused),
    so the boundary inputs were refused although every position fits."""
    _, serving = tiny_pair()

    def padded_length_check(self, text_mask, grid_h, grid_w):
        if text_mask.shape[1] >= self.config.axes_lens[0]:
            raise ValueError("exceed axes_lens (padded length)")

    monkeypatch.setattr(type(serving.module), "_check_positions", padded_length_check)
    with pytest.raises(ValueError, match="padded length"):
        test_serving_accepts_text_length_128_with_127_real_tokens()


def test_rope_theta_is_live_in_the_serving_model():
    """The sensitivity catalogue mutates the serving RoPE θ: it must change the velocity."""
    reference, serving = tiny_pair()
    text, mask = serving.text_condition(77, seed=3)
    x, t = latents((1, 16, 32, 32)), torch.tensor([0.4])
    base = serving.forward(x, t, text, mask)
    torch.testing.assert_close(base, reference.forward(x, t, text, mask), atol=1e-5, rtol=1e-5)
    serving.module.rope_embedder.theta = 500.0
    assert (serving.forward(x, t, text, mask) - base).abs().max() > 1e-3
    rebuilt = ServingDiT.build(dataclasses.replace(tiny_config(), rope_theta=500.0), tiny_state())
    assert (rebuilt.forward(x, t, text, mask) - base).abs().max() > 1e-3

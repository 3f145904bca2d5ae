"""Flow-matching schedule, CFG range, and the full sampling loop: serving vs reference."""

from __future__ import annotations

import types

import pytest
import torch

from parity.compare.images import psnr
from reference_models.dit import sampler as ref_sampler
from serving_models.dit import adapter as serving_adapter
from serving_models.dit import sampler as srv_sampler
from tests.support.dit_support import tiny_pair

SAMPLERS = [ref_sampler, srv_sampler]


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["reference", "serving"])
def test_time_shift_by_hand(sampler):
    # m = sqrt(h*w)/40: 32x32 latents -> 0.8; t' = t / (m - m t + t) = t / (0.8 + 0.2 t).
    expected = [0.0, 0.25 / 0.85, 0.5 / 0.9, 0.75 / 0.95, 1.0]
    torch.testing.assert_close(sampler.flow_match_timesteps(4, 32, 32), torch.tensor(expected), atol=1e-7, rtol=1e-6)
    # 1024^2 pixels = 128x128 latents: m = 3.2 (docs/model.md §8); t = 0.5 -> 0.5 / 2.1.
    times = sampler.flow_match_timesteps(2, 128, 128)
    torch.testing.assert_close(times, torch.tensor([0.0, 0.5 / 2.1, 1.0]), atol=1e-7, rtol=1e-6)
    # Non-square: 32x64 -> m = sqrt(2048)/40.
    m = 2048**0.5 / 40
    torch.testing.assert_close(
        sampler.flow_match_timesteps(2, 32, 64)[1], torch.tensor(0.5 / (m - m * 0.5 + 0.5)), atol=1e-7, rtol=1e-6
    )
    assert ref_sampler.time_shift(128, 128) == pytest.approx(3.2)


GUIDANCE = {"reference": ref_sampler.guidance_scales, "serving": srv_sampler.guidance_per_step}


@pytest.mark.parametrize("scales", GUIDANCE.values(), ids=GUIDANCE.keys())
def test_cfg_range_latches_off_at_the_first_step_outside(scales):
    """The release's semantics (docs/model.md §8): the scale drops to 1.0 at the first step whose
    i/N is outside the range and stays there; the range is inclusive on i/N."""
    assert scales(4, 4.0, (0.0, 0.5)) == [4.0, 4.0, 4.0, 1.0]
    assert scales(4, 4.0, (0.0, 1.0)) == [4.0] * 4
    # Not starting at 0: step 0 is outside, so CFG never runs (a per-step rule would run 2 and 3).
    assert scales(4, 4.0, (0.3, 1.0)) == [1.0] * 4
    assert scales(6, 4.0, (0.34, 1.0)) == [1.0] * 6
    # A gap: in range at 0, out at 1, back in at 2: off from step 1 on.
    assert scales(4, 4.0, (0.0, 0.2)) == [4.0, 1.0, 1.0, 1.0]
    assert scales(4, 1.0, (0.0, 1.0)) == [1.0] * 4


def per_step_scales(steps, guidance_scale, cfg_range):
    """The defect the latch replaces: CFG decided per step from i/N alone."""
    return [guidance_scale if cfg_range[0] <= i / steps <= cfg_range[1] else 1.0 for i in range(steps)]


def test_latch_test_fails_for_a_per_step_cfg_range(monkeypatch):
    monkeypatch.setitem(GUIDANCE, "serving", per_step_scales)
    with pytest.raises(AssertionError):
        test_cfg_range_latches_off_at_the_first_step_outside(GUIDANCE["serving"])


def test_seeded_inputs_are_identical_in_both_packages():
    assert torch.equal(ref_sampler.initial_noise((1, 16, 8, 8), 3), srv_sampler.initial_noise((1, 16, 8, 8), 3))
    for a, b in zip(ref_sampler.text_condition(64, 5, 7), srv_sampler.text_condition(64, 5, 7)):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.mark.parametrize("text_len", [0, 4, 77])
def test_sampling_loop_matches_reference(pair, text_len):
    """4 steps, guidance 4.0, cfg_range (0, 1): serving runs two batch-1 calls per step, the
    reference one doubled batch with an all-false unconditional mask."""
    reference, serving = pair
    text, mask = serving.text_condition(text_len, seed=11)
    ref_latents = reference.sample(text, mask, 32, 32, 4, 4.0, (0.0, 1.0), seed=42)
    srv_latents = serving.sample(text, mask, 32, 32, 4, 4.0, (0.0, 1.0), seed=42)
    assert ref_latents.dtype == torch.float32
    # Per-step velocity differences (FP32 reorderings, ~1e-6) accumulate over 4 steps x 4.0 CFG.
    torch.testing.assert_close(srv_latents, ref_latents, atol=5e-5, rtol=5e-5)
    ref_img, srv_img = reference.decode(ref_latents), serving.decode(srv_latents)
    assert ref_img.shape == (1, 256, 256, 3) and ref_img.dtype == torch.uint8
    # uint8 rounding can flip a pixel whose value sits at .5 by one level; no more.
    assert (ref_img.int() - srv_img.int()).abs().max() <= 1


def test_sampling_is_deterministic_and_seeded(pair):
    _, serving = pair
    text, mask = serving.text_condition(4, seed=11)
    a = serving.generate(text, mask, 16, 16, 4, 4.0, seed=1)
    assert torch.equal(a, serving.generate(text, mask, 16, 16, 4, 4.0, seed=1))
    assert not torch.equal(a, serving.generate(text, mask, 16, 16, 4, 4.0, seed=2))


def test_guidance_and_text_change_the_image(pair):
    """Non-vacuous: CFG and the text visibly move the decoded image (grey levels)."""
    _, serving = pair
    text, mask = serving.text_condition(77, seed=11)
    guided = serving.generate(text, mask, 16, 16, 4, 4.0, seed=1).float()
    unguided = serving.generate(text, mask, 16, 16, 4, 1.0, seed=1).float()
    other_text = serving.generate(*serving.text_condition(77, seed=12), 16, 16, 4, 4.0, seed=1).float()
    assert (guided - unguided).abs().mean() > 1.0
    assert (guided - other_text).abs().mean() > 1.0


def test_comparison_catches_a_wrong_unconditional_stream(pair):
    """Mutant: the serving port feeds the conditional text to the unconditional pass too."""
    reference, serving = pair
    text, mask = serving.text_condition(4, seed=11)
    expected = reference.sample(text, mask, 32, 32, 4, 4.0, seed=42)
    real_module = serving.module

    class UncondSeesText(torch.nn.Module):
        def forward(self, latents, timestep, text_states, text_mask):
            if text_states.shape[1] == 0:
                text_states, text_mask = text, mask
            return real_module(latents, timestep, text_states, text_mask)

    mutant = types.SimpleNamespace(**vars(serving))
    mutant.module = UncondSeesText()
    wrong = type(serving).sample(mutant, text, mask, 32, 32, 4, 4.0, seed=42)
    assert (wrong - expected).abs().max() > 1e-2


def test_decode_shape_follows_the_latent_grid(pair):
    reference, serving = pair
    lat = torch.randn(2, 16, 16, 24, generator=torch.Generator().manual_seed(0))
    for adapter in pair:
        img = adapter.decode(lat)
        assert img.shape == (2, 128, 192, 3) and img.dtype == torch.uint8
        assert img.float().std() > 10  # a real image, not a flat grey
    assert torch.equal(reference.decode(lat), serving.decode(lat))


# --- the release's loop: CFG range latch, model-dtype state, negative prompt -----------------------


def test_a_cfg_range_not_starting_at_zero_is_the_guidance_one_run(pair):
    """(0.34, 1.0) with guidance 4: step 0 is outside, so the release runs no CFG at all and its
    latents equal the guidance-1 run bit for bit, in both packages."""
    text, mask = pair[1].text_condition(7, seed=11)
    for adapter in pair:
        late = adapter.sample(text, mask, 32, 48, 6, 4.0, (0.34, 1.0), seed=3)
        assert torch.equal(late, adapter.sample(text, mask, 32, 48, 6, 1.0, (0.0, 1.0), seed=3))


def test_per_step_cfg_range_moves_the_image(pair, monkeypatch):
    """The defect: CFG decided per step runs steps 3-5 of 6 with guidance 4; the image falls below
    the fp32 image floor of 40 dB (measured 36.9 dB at 32x48 with 77 text tokens, tiny seed 0; 46.8
    dB with 7 tokens, where the text moves the velocity less)."""
    _, serving = pair
    text, mask = serving.text_condition(77, seed=3)
    release = serving.generate(text, mask, 32, 48, 6, 4.0, (0.34, 1.0), seed=3)
    monkeypatch.setattr(serving_adapter, "guidance_per_step", per_step_scales)
    per_step = serving.generate(text, mask, 32, 48, 6, 4.0, (0.34, 1.0), seed=3)
    assert psnr(release[0].numpy(), per_step[0].numpy(), data_range=255).value < 40.0


def loop_without_cfg(adapter, text, mask, height, width, steps, seed, *, state_dtype=None):
    """The release's loop written out for guidance 1: the state in the model dtype between steps
    (or `state_dtype`, the defect), the Euler sum in float32 with the step size times the velocity
    in the velocity's dtype."""
    state_dtype = state_dtype or adapter.dtype
    times = ref_sampler.flow_match_timesteps(steps, height, width)
    x = ref_sampler.initial_noise((1, 16, height, width), seed).to(state_dtype)
    for i in range(steps):
        v = adapter.module(x.to(adapter.dtype), times[i].expand(1).to(adapter.dtype), text.to(adapter.dtype), mask)
        x = (x.float() + (times[i + 1] - times[i]) * v).to(state_dtype)
    return x


def test_bf16_latents_stay_bf16_between_steps():
    text, mask = ref_sampler.text_condition(64, 7, seed=11)
    for adapter in tiny_pair(torch.bfloat16):
        got = adapter.sample(text, mask, 32, 32, 6, 1.0, seed=3)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, loop_without_cfg(adapter, text, mask, 32, 32, 6, seed=3))


def test_fp32_state_between_steps_is_told_apart_in_bf16():
    """The defect: fp32 latents between the steps of a bf16 model (measured: 0.07 max abs after 6
    steps, 0.16 after 20, with guidance 4; the image 49 dB from the release's, inside bf16 image
    noise, which is why the sampler suite compares loops with a stand-in velocity, bit for bit)."""
    reference, _ = tiny_pair(torch.bfloat16)
    text, mask = ref_sampler.text_condition(64, 7, seed=11)
    release = reference.sample(text, mask, 32, 32, 6, 1.0, seed=3)
    fp32_state = loop_without_cfg(reference, text, mask, 32, 32, 6, seed=3, state_dtype=torch.float32)
    assert (fp32_state - release.float()).abs().max() > 1e-2


def test_negative_prompt_drives_the_unconditional_branch(pair):
    reference, serving = pair
    text, mask = serving.text_condition(7, seed=11)
    negative, negative_mask = serving.text_condition(12, seed=12)
    with_negative = serving.sample(text, mask, 32, 32, 4, 4.0, seed=3, negative_states=negative, negative_mask=negative_mask)
    # fp32 summation-order noise over 4 steps x guidance 4, as test_sampling_loop_matches_reference
    torch.testing.assert_close(
        with_negative,
        reference.sample(text, mask, 32, 32, 4, 4.0, seed=3, negative_states=negative, negative_mask=negative_mask),
        atol=5e-5,
        rtol=5e-5,
    )
    # Without a negative prompt both still take empty text (measured: the negative moves the
    # latents by 0.57 max abs, the image to 34 dB).
    empty = serving.sample(text, mask, 32, 32, 4, 4.0, seed=3)
    assert (with_negative - empty).abs().max() > 0.1
    torch.testing.assert_close(empty, reference.sample(text, mask, 32, 32, 4, 4.0, seed=3), atol=5e-5, rtol=5e-5)


def test_a_port_that_drops_the_negative_prompt_is_caught(pair):
    reference, serving = pair
    text, mask = serving.text_condition(7, seed=11)
    negative, negative_mask = serving.text_condition(12, seed=12)
    expected = reference.sample(text, mask, 32, 32, 4, 4.0, seed=3, negative_states=negative, negative_mask=negative_mask)
    dropped = serving.sample(text, mask, 32, 32, 4, 4.0, seed=3)  # what a port without the argument does
    assert (dropped - expected).abs().max() > 5e-5 * (1 + expected.abs().max())

"""Flow-matching schedule, CFG range, and the full sampling loop: serving vs reference."""

from __future__ import annotations

import types

import pytest
import torch

from reference_models.dit import sampler as ref_sampler
from serving_models.dit import sampler as srv_sampler
from tests.dit_support import tiny_pair

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


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["reference", "serving"])
def test_cfg_range_is_inclusive_on_i_over_n(sampler):
    assert [sampler.cfg_active(i, 4, 4.0, (0.0, 0.5)) for i in range(4)] == [True, True, True, False]
    assert [sampler.cfg_active(i, 4, 4.0, (0.3, 1.0)) for i in range(4)] == [False, False, True, True]
    assert not any(sampler.cfg_active(i, 4, 1.0, (0.0, 1.0)) for i in range(4))


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

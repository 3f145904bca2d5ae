"""Known-answer tests of parity.compare.images (PSNR, SSIM, conversions, PNG)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from PIL import Image

from parity.compare.images import psnr, ssim, to_uint8, write_png


def test_psnr_matches_the_closed_form_for_a_known_mse_uint8() -> None:
    ref = np.full((16, 16, 3), 100, dtype=np.uint8)
    cand = ref.copy()
    cand[::2] += 4  # half the pixels off by 4: MSE = 8
    score = psnr(ref, cand, data_range=255)
    assert score.value == pytest.approx(10 * math.log10(255**2 / 8.0))
    assert score.data_range == 255 and not score.identical


def test_psnr_uses_the_given_data_range_not_an_inferred_one() -> None:
    # scikit-image would infer data_range=1 from a non-negative float reference; the caller says 2.
    rng = np.random.default_rng(0)
    ref = rng.uniform(0.0, 1.0, (8, 8, 3))
    cand = ref + 0.01
    score = psnr(ref, cand, data_range=2.0)
    assert score.value == pytest.approx(10 * math.log10(4.0 / 1e-4))
    assert score.data_range == 2.0


def test_psnr_is_computed_without_uint8_wraparound() -> None:
    ref = np.array([[250]], dtype=np.uint8)
    cand = np.array([[5]], dtype=np.uint8)
    assert psnr(ref, cand, data_range=255).value == pytest.approx(10 * math.log10(255**2 / 245**2))


def test_identical_images_are_inf_without_warning_noise() -> None:
    image = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        score = psnr(image, image.copy(), data_range=255)
    assert score.value == math.inf and score.identical


def test_psnr_requires_a_valid_data_range_and_matching_shapes() -> None:
    image = np.zeros((4, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="data_range"):
        psnr(image, image, data_range=0)
    with pytest.raises(ValueError, match="shape mismatch"):
        psnr(image, np.zeros((4, 5)), data_range=1.0)


def test_ssim_of_identical_rgb_images_is_one_and_noise_lowers_it() -> None:
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)
    assert ssim(image, image.copy(), data_range=255).value == pytest.approx(1.0)
    noisy = np.clip(image.astype(int) + rng.integers(-40, 40, image.shape), 0, 255).astype(np.uint8)
    value = ssim(image, noisy, data_range=255).value
    assert 0.0 < value < 0.99


def test_ssim_treats_the_last_axis_as_colour_channels() -> None:
    # Treated as a 3-D volume, a 16 x 16 x 3 image would fail ("win_size exceeds image extent").
    rng = np.random.default_rng(2)
    image = rng.uniform(0, 1, (16, 16, 3))
    assert ssim(image, image * 0.9, data_range=1.0).value < 1.0


def test_ssim_rejects_images_smaller_than_its_window() -> None:
    with pytest.raises(ValueError, match="at least 7x7"):
        ssim(np.zeros((6, 6, 3)), np.zeros((6, 6, 3)), data_range=1.0)


def test_to_uint8_maps_the_stated_range_and_clips() -> None:
    image = np.array([[-1.0, 0.0, 1.0, 2.0]])
    assert to_uint8(image, value_range=(-1.0, 1.0)).tolist() == [[0, 128, 255, 255]]
    assert to_uint8(np.array([[0.0, 0.5, 1.0]]), value_range=(0.0, 1.0)).tolist() == [[0, 128, 255]]


def test_write_png_round_trips(tmp_path) -> None:
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (9, 7, 3), dtype=np.uint8)
    path = write_png(image, tmp_path / "sub" / "img.png")
    assert np.array_equal(np.asarray(Image.open(path)), image)
    with pytest.raises(TypeError, match="uint8"):
        write_png(image.astype(np.float32), tmp_path / "bad.png")

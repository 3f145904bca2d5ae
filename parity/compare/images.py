"""Image metrics with an explicit, recorded data range, and PNG writing.

scikit-image infers `data_range` from the *reference* image when it is not given (1 if its minimum
is >= 0, else 2), so the same pair scores 40.1 or 46.1 dB depending on one pixel
(docs/images.md §1). Here `data_range` is a required argument and is returned with the score, so it lands in
the report row. Identical images are reported as `inf` without numpy's divide-by-zero warning.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

ArrayLike = np.ndarray | torch.Tensor


@dataclasses.dataclass(frozen=True)
class ImageScore:
    """One metric value and the data range it was computed with."""

    metric: str
    value: float
    data_range: float
    identical: bool


def _as_numpy(image: ArrayLike) -> np.ndarray:
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu()
        if image.dtype == torch.bfloat16:
            image = image.float()
        image = image.numpy()
    return np.asarray(image)


def _check_pair(reference: np.ndarray, candidate: np.ndarray, data_range: float) -> None:
    if reference.shape != candidate.shape:
        raise ValueError(f"image shape mismatch: reference {reference.shape} vs candidate {candidate.shape}")
    if not (isinstance(data_range, (int, float)) and data_range > 0 and math.isfinite(data_range)):
        raise ValueError(f"data_range must be a positive finite number, got {data_range!r}")


def _as_float_pair(reference: np.ndarray, candidate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # uint8 inputs are promoted so a difference never wraps around.
    return reference.astype(np.float64), candidate.astype(np.float64)


def psnr(reference: ArrayLike, candidate: ArrayLike, *, data_range: float) -> ImageScore:
    """PSNR in dB of `candidate` against `reference` (that order), `inf` for identical images."""
    ref, cand = _as_numpy(reference), _as_numpy(candidate)
    _check_pair(ref, cand, data_range)
    ref64, cand64 = _as_float_pair(ref, cand)
    if np.array_equal(ref64, cand64):
        return ImageScore("psnr", math.inf, float(data_range), True)
    value = peak_signal_noise_ratio(ref64, cand64, data_range=data_range)
    return ImageScore("psnr", float(value), float(data_range), False)


def ssim(reference: ArrayLike, candidate: ArrayLike, *, data_range: float) -> ImageScore:
    """SSIM with Wang et al.'s settings; an H x W x 3 image is treated as RGB (channel_axis=-1).

    Images under 7 x 7 pixels are rejected with a clear error (the 7 x 7 window would not fit).
    """
    ref, cand = _as_numpy(reference), _as_numpy(candidate)
    _check_pair(ref, cand, data_range)
    rgb = ref.ndim == 3 and ref.shape[-1] in (3, 4)
    spatial = ref.shape[:2]
    if min(spatial) < 7:
        raise ValueError(f"SSIM needs images of at least 7x7 pixels, got {spatial}")
    ref64, cand64 = _as_float_pair(ref, cand)
    value = structural_similarity(
        ref64,
        cand64,
        data_range=data_range,
        channel_axis=-1 if rgb else None,
        gaussian_weights=True,
        sigma=1.5,
        use_sample_covariance=False,
    )
    return ImageScore("ssim", float(value), float(data_range), bool(np.array_equal(ref64, cand64)))


def to_uint8(image: ArrayLike, *, value_range: tuple[float, float]) -> np.ndarray:
    """Map a float image in `value_range` (e.g. (0, 1) or (-1, 1)) to uint8, clipping outside it.

    Already-uint8 input is returned unchanged; the caller states the float range, never inferred.
    """
    array = _as_numpy(image)
    if array.dtype == np.uint8:
        return array
    lo, hi = value_range
    if not hi > lo:
        raise ValueError(f"value_range must be increasing, got {value_range}")
    scaled = (array.astype(np.float64) - lo) / (hi - lo) * 255.0
    return np.clip(np.rint(scaled), 0, 255).astype(np.uint8)


def write_png(image: ArrayLike, path: str | Path) -> Path:
    """Write an H x W x 3 (or H x W) uint8 image as a PNG; creates parent directories."""
    from PIL import Image  # Pillow ships with scikit-image's and matplotlib's dependencies

    array = _as_numpy(image)
    if array.dtype != np.uint8:
        raise TypeError(f"write_png takes uint8 images (use to_uint8 first), got {array.dtype}")
    if array.ndim not in (2, 3):
        raise ValueError(f"write_png takes H x W or H x W x C images, got shape {array.shape}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, format="PNG")
    return path

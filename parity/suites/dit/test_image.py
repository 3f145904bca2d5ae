"""Image: the whole DiT stage (sampling loop with CFG, then the decoder), same seed, compared as
delivered uint8 RGB images with PSNR and SSIM (data_range 255, SSIM over RGB with channel_axis=-1).

Pairs: serving eager vs reference (`mode` eager), serving compiled (regional compile, Inductor)
vs serving eager (`mode` compiled). In every dtype each candidate is judged by its distance from
the fp64 golden image relative to its comparison image's (`image_bound`: the bound is measured in
the run, `cases/dit.toml` [image_thresholds] says why; `parity.suites.dit.support.image_bound`), the pairwise PSNR and SSIM recorded
beside it.

Every image is written to `<run_dir>/images/<case>/<variant>.png` (variants `reference`,
`serving_eager`, `serving_compiled` and `golden`); the relative paths are in the rows' detail.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from parity.compare import AT_LEAST, MEASURED, Verdict, threshold_rule
from parity.compare.images import psnr, ssim, write_png
from parity.suites.conftest import require_graph_support
from parity.suites.dit.localise import explain_image
from parity.suites.dit.support import (
    CASES,
    IMAGE_DATA_RANGE,
    DiTModels,
    ImageCase,
    ImageThreshold,
    cases_for,
    compiled_for_comparison,
    image_bound,
    image_path,
    image_threshold,
    require_size,
    text_inputs,
)

pytestmark = pytest.mark.parity_suite("image")

DATA_RANGE = IMAGE_DATA_RANGE


def generate(adapter: Any, models: DiTModels, case: ImageCase, seed_offset: int) -> np.ndarray:
    """One image `[H, W, 3]` uint8 from the adapter's own pipeline (sample with CFG, then decode)."""
    states, mask = text_inputs(models.config, [case.text_len], case.text_seed + seed_offset)
    negative = {}
    if case.negative_len:  # only then: a target without negative prompts still runs the other cases
        negative_states, negative_mask = text_inputs(models.config, [case.negative_len], case.negative_seed + seed_offset)
        negative = {"negative_states": negative_states, "negative_mask": negative_mask}
    latents = adapter.sample(
        states,
        mask,
        case.height,
        case.width,
        case.steps,
        case.guidance_scale,
        case.cfg_range,
        case.seed + seed_offset,
        **negative,
    )
    images = adapter.decode(latents)
    image = images[0].detach().cpu().numpy()
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        got = f"{image.dtype} {tuple(images.shape)}"
        raise TypeError(f"{adapter.name}: decode must return uint8 [B, H, W, 3], got {got}")
    return image


def _generator(models: DiTModels, case: ImageCase, seed_offset: int) -> Any:
    """`generate` of one case for any adapter: what the localisation re-runs on each side."""
    return lambda adapter: generate(adapter, models, case, seed_offset)


def save(run_dir: Path, case: ImageCase, variant: str, image: np.ndarray) -> str:
    """Write the PNG (through a temporary file and a rename: both image tests write
    `serving_eager.png`, possibly from two xdist workers) and return its path relative to the run."""
    path = image_path(run_dir, case.name, variant)
    partial = write_png(image, path.with_name(f"{path.stem}.{os.getpid()}.partial.png"))
    os.replace(partial, path)
    return str(path.relative_to(run_dir))


class GoldenImages:
    """fp64 golden images of a session, generated once per case."""

    def __init__(self) -> None:
        self.images: dict[tuple[str, int], np.ndarray] = {}

    def get(self, models: DiTModels, case: ImageCase, seed_offset: int, run_dir: Path) -> tuple[np.ndarray, str]:
        key = (case.name, seed_offset)
        if key not in self.images:
            self.images[key] = generate(models.golden, models, case, seed_offset)
        image = self.images[key]
        return image, save(run_dir, case, "golden", image)


@pytest.fixture(scope="session")
def golden_images() -> GoldenImages:
    return GoldenImages()


def judge_pair(
    report: Any,
    threshold: ImageThreshold,
    comparison: tuple[str, np.ndarray, str],
    candidate: tuple[str, np.ndarray, str],
    golden: tuple[np.ndarray, str],
    **where: Any,
) -> Verdict:
    """Rows for one (comparison, candidate) pair: the gate `psnr_vs_golden` (returned), with `psnr`
    and `ssim` (pairwise) beside it. Arguments are (variant, image, relative path)."""
    comp_name, comp_image, comp_path = comparison
    cand_name, cand_image, cand_path = candidate
    p = psnr(comp_image, cand_image, data_range=DATA_RANGE)
    s = ssim(comp_image, cand_image, data_range=DATA_RANGE)
    levels = int(np.abs(comp_image.astype(np.int16) - cand_image.astype(np.int16)).max())
    pair = (
        f"{cand_name} vs {comp_name}: {cand_path} vs {comp_path}; data_range={p.data_range:g}; "
        f"identical={p.identical}; max diff {levels} levels"
    )
    report.info(metric="psnr", value=p.value, detail=pair, **where)
    detail = f"{pair}; SSIM Gaussian sigma 1.5 over RGB (channel_axis=-1)"
    report.info(metric="ssim", value=s.value, detail=detail, **where)
    golden_image, golden_path = golden
    cand = psnr(golden_image, cand_image, data_range=DATA_RANGE).value
    bound, how = image_bound(golden_image, comp_image, threshold)
    flips = int((golden_image != cand_image).sum())
    return report.verdict(
        threshold_rule(
            cand,
            bound,
            metric="psnr_vs_golden",
            at=AT_LEAST,
            detail=f"PSNR({golden_path}, {cand_path}) = {cand:.2f} dB ({flips} values differ); bound: {how} "
            f"(comparison {comp_path}); data_range={DATA_RANGE:g}; {threshold.reason}",
            bound=MEASURED,  # the comparison image's PSNR against the golden, measured in this run
        ),
        **where,
    )


@pytest.mark.parametrize("case", CASES["image"], ids=[c.name for c in CASES["image"]])
def test_serving_images_match_reference(case: ImageCase, dit_models: DiTModels, report, settings, run_dir, golden_images) -> None:
    models = dit_models
    require_size("image", case, models.size)
    threshold = image_threshold(models.dtype)
    report.case = case.name  # an exception's error row names this case
    reference = generate(models.reference, models, case, settings.seed)
    serving = generate(models.target, models, case, settings.seed)
    golden = golden_images.get(models, case, settings.seed, run_dir)
    verdict = judge_pair(
        report,
        threshold,
        ("reference", reference, save(run_dir, case, "reference", reference)),
        ("serving_eager", serving, save(run_dir, case, "serving_eager", serving)),
        golden,
        case=case.name,
        mode="eager",
        seed=case.seed + settings.seed,
    )
    if not verdict.ok:  # which stage of the sampling loop or the decoder (docs/localise.md)
        explain_image(models, _generator(models, case, settings.seed), "eager", report, run_dir, case=case.name)


@pytest.mark.parity_compiles
def test_compiled_images_match_eager(dit_models: DiTModels, report, settings, run_dir, golden_images) -> None:
    """The whole sampling loop through regionally compiled blocks (Inductor), one compile for all
    cases: they share one test on purpose (the compiled module serves them all, as in serving)."""
    models = dit_models
    adapter = models.target
    require_graph_support(adapter, "compiled")
    threshold = image_threshold(models.dtype)
    cases = cases_for("image", models.size)
    assert cases, f"no [[image]] cases for size {models.size}"
    report.mode = "compiled"
    report.seed = settings.seed
    eager = {case.name: generate(adapter, models, case, settings.seed) for case in cases}
    goldens = {case.name: golden_images.get(models, case, settings.seed, run_dir) for case in cases}

    failing = []
    with compiled_for_comparison(report, adapter):
        for case in cases:
            compiled = generate(adapter, models, case, settings.seed)
            verdict = judge_pair(
                report,
                threshold,
                ("serving_eager", eager[case.name], save(run_dir, case, "serving_eager", eager[case.name])),
                ("serving_compiled", compiled, save(run_dir, case, "serving_compiled", compiled)),
                goldens[case.name],
                case=case.name,
                mode="compiled",
                seed=case.seed + settings.seed,
            )
            if not verdict.ok:
                failing.append(case)
    # Which stage, compiled again with stage taps, outside the counted compile (docs/localise.md).
    for case in failing:
        explain_image(models, _generator(models, case, settings.seed), "compiled", report, run_dir, case=case.name)

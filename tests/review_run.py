"""The real tiny run the review tests read.

`make_tiny_run` runs `parity run` in fresh processes (results.csv, run.json, index.html): the
suites the page draws (numerics, recompiles, image, routing, decode, self-checks) and one mutant
of the sensitivity suite. `SYNTHETIC = True` is the fallback used before the model suites existed:
the self-checks only, plus SYNTHETIC rows and PNGs in the suites' row conventions (everything below
`SYNTHETIC ADDITIONS` is test data, not a measurement).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from parity.compare.images import psnr, ssim, write_png
from parity.report import CONTEXT_COLUMNS, RESULTS_FILE, ReportWriter, read_results
from tests.helpers import run_parity

SYNTHETIC = False  # True: only the self-checks run and SYNTHETIC rows stand in for the model suites

# The suites whose rows the page draws (numerics plots, the recompile ledger, images, routing
# audit); sensitivity adds one real mutant run (its control runs take minutes, so one mutant).
PAGE_SUITES = ("selfcheck", "numerics", "recompiles", "image", "routing", "decode")
SENSITIVITY_SAMPLE = "no-clamp-gen-side"


@dataclasses.dataclass(frozen=True)
class TinyRun:
    run_dir: Path
    run_stdout: str
    page_written_by_run: bool


def make_tiny_run(report_dir: Path, run_id: str = "tiny") -> TinyRun:
    base = ["run", "--report-dir", str(report_dir), "--run-id", run_id]
    if SYNTHETIC:
        runs = [base + ["--suite", "selfcheck"]]
    else:
        runs = [
            base + [arg for suite in PAGE_SUITES for arg in ("--suite", suite)] + ["-n", "2"],
            base + ["--append", "--suite", "sensitivity", "--", "-k", f"test_mutant_is_killed and {SENSITIVITY_SAMPLE}"],
        ]
    stdout = ""
    for args in runs:  # the second run appends its rows to the same run directory (--append)
        result = run_parity(args, timeout=900)
        stdout += result.stdout
        if result.returncode != 0:
            raise RuntimeError(f"parity run failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}")
    run_dir = report_dir / run_id
    page_written = (run_dir / "index.html").is_file()
    if SYNTHETIC:
        add_synthetic_suite_rows(run_dir)
        from parity.report.page import write_page
        from parity.report.review import load_review

        write_page(load_review(run_dir, use_default_baseline=False))
    return TinyRun(run_dir, stdout, page_written)


def writer_for(run_dir: Path) -> ReportWriter:
    """A writer with the context (run id, target, device, ...) of the run's existing rows."""
    first = read_results(run_dir).iloc[0]
    return ReportWriter(run_dir, {column: first[column] for column in CONTEXT_COLUMNS})


# ---------------------------------------------------------------------------------------------
# SYNTHETIC ADDITIONS: rows in the conventions of the model suites, not measurements.
# ---------------------------------------------------------------------------------------------

AR_SITES = [f"layer.{i}" for i in range(6)] + ["logits"]
DIT_SITES = ["block.noise_refiner.0", "block.context_refiner.0", "block.layers.0", "block.layers.1", "velocity"]
NUMERICS_BOUND = 1e-5  # docs/tolerances.md §1: eager vs Inductor on CPU at atol = 1e-5


def _numerics_rows(case: str, mode: str, sites: list[str], errors: list[float]) -> list[dict]:
    rows = []
    for site, err in zip(sites, errors):
        verdict = "pass" if err <= NUMERICS_BOUND else "fail"
        rows.append(
            dict(
                suite="numerics",
                case=case,
                mode=mode,
                site=site,
                metric="max_abs",
                value=err,
                threshold=NUMERICS_BOUND,
                verdict=verdict,
                better="lower",
                detail=f"{site} (SYNTHETIC)",
            )
        )
        for metric, value, better in (
            ("rel_l2", err / 3, "lower"),
            ("mean_abs", err / 10, "lower"),
            ("cosine", 1 - err, "higher"),
            ("max_ulp", err * 1e6, "lower"),
        ):
            rows.append(
                dict(
                    suite="numerics",
                    case=case,
                    mode=mode,
                    site=site,
                    metric=metric,
                    value=value,
                    verdict=verdict,
                    kind="info",
                    better=better,
                    detail=site,
                )
            )
    return rows


def _synthetic_images(run_dir: Path, case: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:64, 0:64]
    reference = np.stack([x * 4, y * 4, ((x - 32) ** 2 + (y - 32) ** 2 < 300) * 200], axis=-1).clip(0, 255).astype(np.uint8)
    compiled = reference.astype(np.int16)
    compiled[20:40, 10:50] += rng.integers(-3, 4, size=(20, 40, 3), dtype=np.int16)
    images = {
        "reference": reference,
        "serving_eager": reference.copy(),
        "serving_compiled": compiled.clip(0, 255).astype(np.uint8),
    }
    for name, image in images.items():
        write_png(image, run_dir / "images" / case / f"{name}.png")
    return images


def add_synthetic_suite_rows(run_dir: Path) -> None:
    """Append SYNTHETIC rows for numerics, recompiles, image, routing and sensitivity (all passing)."""
    writer = writer_for(run_dir)
    rows: list[dict] = []
    ar_eager = [0.0] * 7
    ar_compiled = [2e-7, 4e-7, 6e-7, 9e-7, 1.3e-6, 1.8e-6, 3e-6]
    rows += _numerics_rows("ar-mixed", "eager", AR_SITES, ar_eager)
    rows += _numerics_rows("ar-mixed", "compiled", AR_SITES, ar_compiled)
    rows += _numerics_rows("dit-32x32-text8", "compiled", DIT_SITES, [1e-7, 2e-7, 5e-7, 8e-7, 2e-6])

    lattice = [
        ("latent=32x32,text=0,cfg=off", 1, 1, "first compile"),
        ("latent=32x32,text=8,cfg=off", 1, 0, ""),
        ("latent=32x64,text=8,cfg=on", 2, 1, "tensor 'x' size mismatch at index 2. expected 32, actual 64"),
        ("latent=64x64,text=8,cfg=on", 2, 0, ""),
    ]
    for shape, compiles, new, reason in lattice:
        rows.append(
            dict(
                suite="recompiles",
                case=shape,
                mode="compiled",
                metric="compiles",
                value=compiles,
                threshold=2,
                verdict="pass",
                better="lower",
                detail=reason,
            )
        )
        rows.append(
            dict(
                suite="recompiles",
                case=shape,
                mode="compiled",
                metric="new_compiles",
                value=new,
                threshold=1,
                verdict="pass",
                better="lower",
                detail=reason,
            )
        )
    for metric, value in (("graph_breaks", 0), ("regional_modules_compiled", 2), ("eager_fallback", 0)):
        rows.append(
            dict(
                suite="recompiles",
                case="lattice",
                mode="compiled",
                metric=metric,
                value=value,
                threshold=0 if metric != "regional_modules_compiled" else 2,
                verdict="pass",
                better="lower" if metric != "regional_modules_compiled" else "equal",
            )
        )

    for seed, case in enumerate(("dit-prompt-a", "dit-prompt-b")):
        images = _synthetic_images(run_dir, case, seed)
        paths = f"images/{case}/reference.png images/{case}/serving_eager.png images/{case}/serving_compiled.png"
        for mode, ref, cand in (
            ("eager-vs-compiled", "serving_eager", "serving_compiled"),
            ("serving-vs-reference", "reference", "serving_eager"),
        ):
            p, s = psnr(images[ref], images[cand], data_range=255.0), ssim(images[ref], images[cand], data_range=255.0)
            rows.append(
                dict(
                    suite="image",
                    case=case,
                    mode=mode,
                    metric="psnr",
                    value=p.value,
                    threshold=40.0,
                    verdict="pass",
                    better="higher",
                    detail=f"data_range=255 {paths}",
                )
            )
            rows.append(
                dict(
                    suite="image",
                    case=case,
                    mode=mode,
                    metric="ssim",
                    value=s.value,
                    threshold=0.98,
                    verdict="pass",
                    better="higher",
                    detail=f"data_range=255 {paths}",
                )
            )

    for case, flips in (("grid-e64-k8-t513-bf16-softmax-renorm", 1), ("grid-e8-k2-t1-fp32-sigmoid", 0)):
        rows.append(dict(suite="routing", case=case, mode="eager", metric="ids_mismatch", value=0, threshold=0, verdict="pass"))
        rows.append(
            dict(suite="routing", case=case, mode="eager", metric="weight_max_abs", value=3e-8, threshold=1e-6, verdict="pass")
        )
        rows.append(
            dict(
                suite="routing",
                case=case,
                mode="eager",
                metric="tie_flips",
                value=flips,
                verdict="tie_flip" if flips else "pass",
                site="17" if flips else "",
                detail="row 17: experts 5/9 within 1 ulp" if flips else "",
            )
        )
    for mutant, suite in (("skip-token-clamp", "embedding_clamp"), ("route-after-gather", "routing")):
        rows.append(
            dict(
                suite="sensitivity",
                case=mutant,
                mode=suite,
                metric="killed",
                value=1,
                threshold=1,
                verdict="pass",
                better="equal",
                detail=f"{suite} failed (SYNTHETIC)",
            )
        )
    writer.write_many(rows)


# ---------------------------------------------------------------------------------------------
# Fixtures and copies (the tests change copies, never the session's run)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    """One tiny `parity run` per test session, shared by xdist workers through a lock file in the
    session's common temporary directory; tests change only copies of it."""
    basetemp = tmp_path_factory.getbasetemp()
    # xdist workers' basetemps are popen-gwN/ inside the session's directory; serially the
    # basetemp is the session's directory itself (its parent is shared by every session)
    shared = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    marker = shared / "review-run.done"
    stdout = shared / "review-run.stdout"  # every worker sees the output, not only the one that ran it
    with open(shared / "review-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if marker.exists():
                return TinyRun(Path(marker.read_text()), stdout.read_text(), True)
            run = make_tiny_run(shared / "review-run")
            stdout.write_text(run.run_stdout)
            marker.write_text(str(run.run_dir))
            return run
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def copy_run(run_dir: Path, dest: Path) -> Path:
    shutil.copytree(run_dir, dest)
    return dest


def write_rows(run_dir: Path, frame: pd.DataFrame) -> Path:
    """Replace a run directory's results.csv with `frame` (same columns)."""
    frame.to_csv(run_dir / RESULTS_FILE, index=False)
    return run_dir

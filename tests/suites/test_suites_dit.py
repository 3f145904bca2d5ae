"""The DiT suites (recompiles, numerics, image) are green on the built-in target, and the
recompile suite goes red on a harness whose compile counter counts every frame. (Each DiT mutant
of the catalogue is killed by the sensitivity suite; `--target reference` is run for every suite
by tests/models/test_reference_target.py.)

Every suite run is a pytest session of its own, started from the project root as a user starts
it, with its own report directory; a red run must exit non-zero AND hold the expected failing gate
row in its results.csv (a crash would exit non-zero too, without the row). The sessions run in this
process (`run_suites`: a fresh interpreter would spend most of a run importing torch and the
harness again); what a session patched is put back and what it built is dropped after it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from PIL import Image

from parity.observe.compile_ledger import CompileLedger
from parity.observe.regional import compile_repeated_blocks
from parity.report import read_results
from parity.suites.dit import mutants as mutants_dit
from parity.suites.dit import support as dit_support
from parity.suites.dit.support import block_class, block_codes, cases_for, lattice_for
from parity.suites.dit.test_recompiles import Point, control_target, run_point
from reference_models.checkpoints import make_checkpoint
from tests.support.helpers import run_isolated_session

pytestmark = pytest.mark.parity_slow

RECOMPILES = "parity/suites/dit/test_recompiles.py"
NUMERICS = "parity/suites/dit/test_numerics.py"
IMAGE = "parity/suites/dit/test_image.py"
ALL = [RECOMPILES, NUMERICS, IMAGE]


def run_suites(tmp_path: Path, files: list[str], *extra: str, target: str = "serving") -> tuple[int, pd.DataFrame, str]:
    """Run suite files in a pytest session (`tests.support.helpers.run_isolated_session`); exit code, its results.csv, the output's tail."""
    out = tmp_path / "reports"
    args = [*files, "-q", "--parity-report-dir", str(out), "--parity-run-id", "run", "--parity-target", target, *extra]
    code, output = run_isolated_session(args, tmp_path / "basetemp")
    run_dir = out / "run"
    frame = read_results(run_dir) if (run_dir / "results.csv").exists() else pd.DataFrame()
    return code, frame, output


def failing_gates(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["kind"] == "gate") & frame["verdict"].isin(["fail", "error"])]


def test_correct_target_is_green_and_its_pngs_open(tmp_path: Path) -> None:
    code, frame, output = run_suites(tmp_path, ALL)
    assert code == 0, output
    assert failing_gates(frame).empty
    assert set(frame["suite"]) == {"recompiles", "numerics", "image"}

    # Recompiles: a gate row per warm-up and lattice point, and the warm-up holds every compile.
    lattice = lattice_for("tiny")
    points = frame[(frame["suite"] == "recompiles") & (frame["metric"] == "new_compiles")]
    expected_points = len(lattice.warmup) + len(lattice.sizes) * len(lattice.text_lengths) * len(lattice.cfg)
    assert len(points) == expected_points
    assert "latent=32x64,text=0,cfg=on" in set(points["case"])
    assert points["value"].sum() == sum(p.expected_compiles for p in lattice.warmup) == 3
    warm = points[points["case"] == "warm-up latent=32x32,text=4,cfg=off"]
    assert "norm1" in warm["detail"].iloc[0]  # the recompile reason is recorded: the norm1 type guard

    # Image: every PNG named in a detail exists, opens, and has the decoded size (8x the latents).
    run_dir = tmp_path / "reports" / "run"
    for case in cases_for("image", "tiny"):
        for variant in ("reference", "serving_eager", "serving_compiled"):
            path = run_dir / "images" / case.name / f"{variant}.png"
            with Image.open(path) as image:
                image.load()
                assert image.mode == "RGB" and image.size == (8 * case.width, 8 * case.height), path
            details = frame[(frame["suite"] == "image") & (frame["case"] == case.name)]["detail"]
            assert details.str.contains(f"images/{case.name}/{variant}.png", regex=False).any()


def test_a_counter_of_every_frame_turns_the_recompile_suite_red(tmp_path: Path) -> None:
    """Harness variant: count all frames. The warm-up's control frame (the decoder, compiled on
    its own) is then counted as a block compile: 3 where the case file expects 2."""
    code, frame, output = run_suites(tmp_path, [RECOMPILES], "-p", "tests.support.dit_all_frames_counter")
    assert code != 0, output
    failed = failing_gates(frame)
    first = failed[(failed["metric"] == "new_compiles") & (failed["case"] == "warm-up latent=32x32,text=4,cfg=off")]
    assert list(first["value"]) == [3] and list(first["threshold"]) == [2], failed.to_string()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("dit", "tiny", 0, tmp_path_factory.mktemp("dit"))


def _first_warm_up_point(target, checkpoint: Path) -> tuple[CompileLedger, list]:
    """The recompile suite's first warm-up point (control frame included) on `target`."""
    adapter = target.load_dit(checkpoint, "cpu", torch.float32)
    lattice = lattice_for("tiny")
    codes = block_codes(adapter.module, block_class())
    warm = lattice.warmup[0]
    with CompileLedger() as ledger:
        compile_repeated_blocks(adapter.module, backend=lattice.backend, ledger=ledger)
        control = torch.compile(control_target(adapter), dynamic=True, fullgraph=True, backend=lattice.backend)
        control(run_point(adapter, adapter.config, lattice, Point(warm.height, warm.width, warm.text_len, warm.cfg)))
    return ledger, codes


def test_an_all_frames_counter_misses_emptied_repeated_blocks(tiny_checkpoint: Path) -> None:
    """vllm-project/vllm-omni#7455: with `_repeated_blocks = []` something else still compiles its own frame,
    so "did the first shape compile?" answered from all frames says yes; per code object, no."""
    ledger, codes = _first_warm_up_point(mutants_dit.repeated_blocks_emptied(), tiny_checkpoint)
    assert ledger.compiles() >= 1  # all frames: the seed's `assert count >= 1` passes
    assert dit_support.count_block_compiles(ledger, codes) == 0  # the suite's counter: nothing compiled


def test_the_block_counter_leaves_the_control_frame_out(tiny_checkpoint: Path) -> None:
    from serving_models.target import make_target

    ledger, codes = _first_warm_up_point(make_target(), tiny_checkpoint)
    assert dit_support.count_block_compiles(ledger, codes) == lattice_for("tiny").warmup[0].expected_compiles == 2
    assert ledger.compiles() == 3  # the two block kinds and the decoder

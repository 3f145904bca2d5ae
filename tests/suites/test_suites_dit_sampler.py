"""The sampler suite (schedule and loop) is green on the built-in target, writes schedule rows for
square and non-square latents in both orientations, and goes red on each sampler defect of the
catalogue at the rows that stand for it; the image suite's new cases go red on the two defects
an image can show (a per-step CFG range, a dropped negative prompt).

Every run is a pytest session of its own with its own report directory, run in this process and
isolated from the others (`tests.suites.test_suites_dit.run_suites`); a red run must exit non-zero AND
hold the expected failing gate rows (a crash would exit non-zero without them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parity.suites.dit.support import CASES, cases_for
from tests.suites.test_suites_dit import IMAGE, failing_gates, run_suites

pytestmark = pytest.mark.parity_slow

SAMPLER = "parity/suites/dit/test_sampler.py"
MUTANTS = "parity.suites.dit.mutants"
SQUARE = {f"{h}x{w}" for h, w in CASES["schedule"].sizes if h == w}
SAMPLER_CASES = cases_for("sampler", "tiny")


def schedule_case(steps: int, size: str) -> str:
    return f"dit-schedule-{steps}steps-{size}"


def test_correct_target_is_green_with_non_square_schedule_rows(tmp_path: Path) -> None:
    code, frame, output = run_suites(tmp_path, [SAMPLER])
    assert code == 0, output
    assert failing_gates(frame).empty
    schedule = frame[(frame["metric"] == "max_ulp") & (frame["site"] == "timesteps")]
    sizes = {case.rsplit("-", 1)[1] for case in schedule["case"]}
    assert {"32x32", "32x48", "48x32", "128x128", "64x128", "128x64"} <= sizes
    assert (schedule["value"] == 0).all() and (schedule["threshold"] == 0).all()
    assert len(schedule) == len(CASES["schedule"].steps) * len(CASES["schedule"].sizes)
    shifts = frame[frame["metric"] == "shift"].set_index("case")["value"]
    assert shifts[schedule_case(50, "64x128")] == pytest.approx((64 * 128) ** 0.5 / 40, rel=1e-6)
    loop = frame[frame["case"].isin([c.name for c in SAMPLER_CASES])]
    assert set(loop["metric"]) == {"cfg_trace", "latents_dtype", "mismatched_elements"}
    assert len(loop) == 3 * len(SAMPLER_CASES)


def loop_failures(frame, metric: str) -> set[str]:
    failed = failing_gates(frame)
    return set(failed[failed["metric"] == metric]["case"])


def names(predicate) -> set[str]:
    return {case.name for case in SAMPLER_CASES if predicate(case)}


def late_range(case) -> bool:
    return case.cfg_range[0] > 0


@pytest.mark.parametrize(
    "factory, metric, expected",
    [
        ("sampler_cfg_range_per_step", "cfg_trace", names(late_range)),
        ("sampler_drops_negative_prompt", "cfg_trace", names(lambda c: c.negative_len > 0)),
        ("sampler_fp32_state", "latents_dtype", names(lambda c: c.dtype == "bf16")),
    ],
)
def test_each_loop_defect_fails_its_cases(tmp_path: Path, factory: str, metric: str, expected: set[str]) -> None:
    code, frame, output = run_suites(tmp_path, [SAMPLER, "-k", "loop"], target=f"{MUTANTS}:{factory}")
    assert code != 0, output
    assert expected and loop_failures(frame, metric) == expected, failing_gates(frame).to_string()
    # The bits differ too, and nowhere else.
    assert loop_failures(frame, "mismatched_elements") == expected


def test_each_schedule_defect_fails_its_points(tmp_path: Path) -> None:
    lattice = CASES["schedule"]
    code, frame, output = run_suites(tmp_path, [SAMPLER, "-k", "schedule"], target=f"{MUTANTS}:schedule_shift_from_height")
    assert code != 0, output
    non_square = {schedule_case(s, f"{h}x{w}") for s in lattice.steps for h, w in lattice.sizes if h != w}
    assert loop_failures(frame, "max_ulp") == non_square  # every non-square point, no square one

    code, frame, output = run_suites(
        tmp_path / "linspace", [SAMPLER, "-k", "schedule"], target=f"{MUTANTS}:schedule_torch_linspace"
    )
    assert code != 0, output
    failed = failing_gates(frame)
    assert set(failed["metric"]) == {"max_ulp"} and failed["value"].min() >= 1 and failed["value"].max() <= 4
    assert {case.rsplit("-", 1)[1] for case in failed["case"]} & SQUARE  # square latents too


@pytest.mark.parametrize(
    "factory, case",
    [
        ("sampler_cfg_range_per_step", "dit-image-256x384px-text77-cfg4-late-range"),
        ("sampler_drops_negative_prompt", "dit-image-384x256px-text77-negative30-cfg4"),
    ],
)
def test_the_image_suite_sees_cfg_range_and_negative_prompt_defects(tmp_path: Path, factory: str, case: str) -> None:
    code, frame, output = run_suites(
        tmp_path, [IMAGE, "-k", "test_serving_images_match_reference"], target=f"{MUTANTS}:{factory}"
    )
    assert code != 0, output
    failed = failing_gates(frame)
    assert set(failed["case"]) == {case}, failed.to_string()
    assert "psnr_vs_golden" in set(failed["metric"])  # the golden-relative image gate (docs/images.md)

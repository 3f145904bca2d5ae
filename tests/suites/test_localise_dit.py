"""Localising a failing DiT case names the stage each DiT numerics and image mutant breaks, and
nothing on the correct serving port.

Each mutant's target builds the tiny DiT in fp32 on the CPU; the case its kill selection fails is
re-run through `parity.suites.dit.localise` (`explain_forward` for a velocity case,
`explain_image` for an image case), which must write a `first_diverging_stage` row naming the
catalogue's `stage` (what the sensitivity suite holds every localised case to). The correct port
gives no blamed stage on the same cases, and a stage its map leaves out is reported not observable
while the chain still names the next stage. The compile-only mutant is right in eager (its
catalogue entry says why no one stage is named); compiled, its fused path skips the rotary stage
point, which the chain shows as not observed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

import parity.suites.dit.localise as localise
from parity.localise.chain import FAIL, NOT_OBSERVABLE, NOT_OBSERVED, PASS, Chain
from parity.localise.rows import BLAME_METRIC, STAGE_METRIC
from parity.observe.regional import compile_repeated_blocks
from parity.report import read_results
from parity.suites.dit import mutants
from parity.suites.dit.support import CASES, DiTModels, forward, velocity_inputs
from parity.suites.dit.test_image import generate
from parity.suites.sensitivity.catalogue import all_mutants
from reference_models.dit.adapter import ReferenceDiT
from reference_models.dit.checkpoint import random_state_dict
from reference_models.dit.config import tiny_config
from serving_models.dit.adapter import STAGE_MAP
from serving_models.target import ServingTarget
from tests.support.helpers import run_isolated_session

pytestmark = pytest.mark.parity_cpu

CPU = torch.device("cpu")
SEED_OFFSET = 0  # the suites' --seed

# mutant -> (its factory, the case of its kill selection that is localised here)
VELOCITY_MUTANTS = {
    "dit-rope-theta-from-llm": (mutants.rope_theta_from_llm, "dit-velocity-32x32-text4"),
    "dit-qk-norm-weights-swapped": (mutants.qk_norm_weights_swapped, "dit-velocity-32x32-text4"),
    "dit-adaln-bias-dropped": (mutants.adaln_bias_dropped, "dit-velocity-32x32-text4"),
    "dit-key-padding-mask-dropped": (mutants.key_padding_mask_dropped, "dit-velocity-32x48-padded-9-3"),
}
IMAGE_MUTANTS = {
    "dit-shift-from-width-only": (mutants.shift_from_width_only, "dit-image-256x384px-text4-cfg4-half-range"),
    "dit-cfg-range-end-exclusive": (mutants.cfg_range_end_exclusive, "dit-image-256x384px-text4-cfg4-half-range"),
    "dit-decoder-shift-factor-dropped": (mutants.decoder_shift_factor_dropped, "dit-image-256x384px-text4-cfg4-half-range"),
}


class RowCatcher:
    """The `info` half of the report fixture: the rows a localisation writes."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def info(self, **row: Any) -> None:
        self.rows.append(row)

    def blamed(self) -> list[str]:
        return [row["site"] for row in self.rows if row["metric"] == BLAME_METRIC and row["value"] == 1]


@functools.lru_cache(maxsize=1)
def _truth() -> tuple[Any, dict[str, torch.Tensor], ReferenceDiT, ReferenceDiT]:
    config = tiny_config()
    state = random_state_dict(config, 0)
    reference = ReferenceDiT.build(config, state, CPU, torch.float32)
    golden = ReferenceDiT.build(config, {k: v.double() for k, v in state.items()}, CPU, torch.float64)
    return config, state, reference, golden


def models_for(target: Any) -> DiTModels:
    """The suites' three sides on the tiny config in fp32: `target`'s DiT, the reference, the fp64 golden."""
    config, state, reference, golden = _truth()
    adapter = target.build_dit(config, state, CPU, torch.float32)
    return DiTModels(adapter, reference, golden, config, "tiny", "fp32", CPU, "random_state_dict(tiny, 0)")


def _case(table: str, name: str) -> Any:
    return next(case for case in CASES[table] if case.name == name)


def _velocity_inputs(models: DiTModels, name: str) -> tuple[torch.Tensor, ...]:
    case = _case("velocity", name)
    return velocity_inputs(models.config, case.height, case.width, case.text_lens, case.timestep, case.seed + SEED_OFFSET)


def _image_run(models: DiTModels, name: str) -> Callable[[Any], Any]:
    case = _case("image", name)
    return lambda adapter: generate(adapter, models, case, SEED_OFFSET)


def _judged_within(chain: Chain) -> None:
    judged = [s for s in chain.stages if s.status in (PASS, FAIL)]
    assert judged, chain.stages
    assert all(s.status == PASS for s in judged), [(s.site, s.value, s.bound) for s in judged if s.status != PASS]


@pytest.mark.parametrize("mutant", list(VELOCITY_MUTANTS))
def test_a_velocity_mutant_is_localised_to_its_stage(mutant: str, tmp_path: Path) -> None:
    factory, case = VELOCITY_MUTANTS[mutant]
    expected = all_mutants()[mutant].stage
    assert expected, f"{mutant} names no stage in the catalogue"
    models = models_for(factory())
    report = RowCatcher()
    chain = localise.explain_forward(models, _velocity_inputs(models, case), "eager", report, tmp_path, case=case)
    assert chain.stage("velocity").status == FAIL  # the case's gate (the velocity vs the golden) fails
    assert report.blamed() == [expected], chain.summary()
    blamed = chain.stage(expected)
    assert all(chain.stage(site).status == PASS for site in chain.blamed.inputs), chain.summary()
    assert blamed.value > 10 * blamed.bound  # far out, not at the edge of the noise
    assert (tmp_path / "repro" / f"{case}-eager" / "repro.py").exists()


@pytest.mark.parametrize("mutant", list(IMAGE_MUTANTS))
def test_an_image_mutant_is_localised_to_its_stage(mutant: str, tmp_path: Path) -> None:
    factory, case = IMAGE_MUTANTS[mutant]
    expected = all_mutants()[mutant].stage
    assert expected, f"{mutant} names no stage in the catalogue"
    models = models_for(factory())
    report = RowCatcher()
    chain = localise.explain_image(models, _image_run(models, case), "eager", report, tmp_path, case=case)
    assert chain.stage("decoded").status == FAIL  # the delivered image moved
    assert report.blamed() == [expected], chain.summary()
    assert [s.site for s in chain.stages] == ["timesteps", "guidance", "velocity", "latents", "decoded"]


@pytest.mark.parametrize("case", ["dit-velocity-32x32-text4", "dit-velocity-32x48-padded-9-3"])
def test_the_serving_port_has_no_diverging_stage_on_a_velocity_case(case: str) -> None:
    models = models_for(ServingTarget())
    chain = localise.localise_forward(models, _velocity_inputs(models, case), "eager", compared=case)
    assert chain.blamed is None, chain.summary()
    _judged_within(chain)
    # every stage of every block list is compared: nothing of the reference's chain goes unjudged
    assert [s.site for s in chain.stages if s.status not in (PASS, FAIL)] == []
    assert {"rope", "context_refiner.0.q_rope", "noise_refiner.0.adaln", "layers.1.out", "norm_out"} <= {
        s.site for s in chain.stages
    }


def test_the_serving_port_has_no_diverging_stage_on_an_image_case() -> None:
    models = models_for(ServingTarget())
    case = "dit-image-256x384px-text4-cfg4-half-range"
    chain = localise.localise_image(models, _image_run(models, case), "eager", compared=case)
    assert chain.blamed is None, chain.summary()
    _judged_within(chain)
    assert len(chain.stages) == 5


@pytest.mark.parametrize("layout, blamed", [(None, None), ("packed", "rope")])
def test_the_joint_layout_decides_which_rows_a_padded_case_compares(layout: str | None, blamed: str | None) -> None:
    """The serving port pads between text and image. Undeclared, a padded case compares only the
    tokens every layout places alike (nothing diverges); declared as upstream's packed layout, the
    rows compared are the wrong tokens from the first joint-sequence stage on."""
    models = models_for(ServingTarget())
    models.target.joint_layout = layout
    case = "dit-velocity-32x48-padded-9-3"
    chain = localise.localise_forward(models, _velocity_inputs(models, case), "eager", compared=case)
    assert (chain.blamed.site if chain.blamed else None) == blamed, chain.summary()
    assert chain.stage("context_refiner.0.attn").status == PASS  # the text sequence is the same in every layout


def test_a_stage_the_target_map_leaves_out_is_not_observable() -> None:
    """The q/k-norm mutant with the context refiner's `q_norm` and `k_norm` left out of the target's
    map: those stages are reported not observable (never judged, never skipped silently) and the
    chain names the first stage they feed, whose observable inputs (the q projection, the RoPE
    table) are within bound."""
    models = models_for(mutants.qk_norm_weights_swapped())
    left_out = ("context_refiner.{layer}.q_norm", "context_refiner.{layer}.k_norm")
    models.target.stage_map = {k: v for k, v in STAGE_MAP.items() if k not in left_out}
    case = "dit-velocity-32x32-text4"
    chain = localise.localise_forward(models, _velocity_inputs(models, case), "eager", compared=case)
    for site in ("context_refiner.0.q_norm", "context_refiner.0.k_norm"):
        assert chain.stage(site).status == NOT_OBSERVABLE and "does not declare" in chain.stage(site).detail
    assert chain.stage("noise_refiner.0.q_norm").status == FAIL  # the other block lists' norms are still declared
    assert chain.blamed.site == "context_refiner.0.q_rope"
    assert chain.blamed.inputs == ("context_refiner.0.q", "rope"), chain.summary()


def test_the_compile_only_mutant_is_right_in_eager_and_says_why_no_stage() -> None:
    catalogued = all_mutants()["dit-compiled-rope-rotate-half"]  # a known miss: its stage, and why the chain names another
    assert catalogued.stage.endswith(".q_rope") and "compile-only" in catalogued.stage_note
    models = models_for(mutants.compiled_rope_rotate_half())
    case = "dit-velocity-32x32-text4"
    chain = localise.localise_forward(models, _velocity_inputs(models, case), "eager", compared=case)
    assert chain.blamed is None, chain.summary()


@pytest.mark.parity_slow  # regional compiles of the tiny DiT (aot_eager): seconds
def test_compiled_the_fused_rotation_skips_the_rotary_stage_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the catalogue's stage_note says: under compile q_rope/k_rope are not observed and the
    attention output is the first stage out of bound (the regional compile's backend does not
    matter to the mutant: aot_eager here, for time). A compile without taps first, as the gate's
    is: its cached graph must not be reused without them."""
    monkeypatch.setattr(localise, "COMPARE_BACKEND", "aot_eager")
    models = models_for(mutants.compiled_rope_rotate_half())
    case = "dit-velocity-32x32-text4"
    inputs = _velocity_inputs(models, case)
    regional = compile_repeated_blocks(models.target.module, dynamic=True, fullgraph=True, backend="aot_eager")
    try:
        forward(models.target, inputs)
    finally:
        regional.restore()
    chain = localise.localise_forward(models, inputs, "compiled", compared=case)
    assert chain.stage("context_refiner.0.q_rope").status == NOT_OBSERVED
    assert chain.stage("context_refiner.0.q_norm").status == PASS  # the taps inside the compiled block record
    assert chain.blamed.site == "context_refiner.0.attn", chain.summary()


def _suite_rows(tmp_path: Path, selection: list[str], target: str) -> tuple[int, pd.DataFrame, str]:
    """A suite session on `target` (`tests.support.helpers.run_isolated_session`): exit code, rows, output."""
    out = tmp_path / "reports"
    args = [*selection, "-q", "--parity-report-dir", str(out), "--parity-run-id", "run", "--parity-target", target]
    code, output = run_isolated_session(args, tmp_path / "basetemp")
    return code, read_results(out / "run"), output


@pytest.mark.parity_slow  # suite sessions: seconds each
@pytest.mark.parametrize(
    "selection, mutant",
    [
        (["parity/suites/dit/test_numerics.py", "-k", "velocity and padded"], "key_padding_mask_dropped"),
        (["parity/suites/dit/test_image.py", "-k", "serving_images and half-range"], "cfg_range_end_exclusive"),
    ],
    ids=["numerics", "image"],
)
def test_the_suites_localise_a_failing_case_and_only_a_failing_one(tmp_path: Path, selection: list[str], mutant: str) -> None:
    """The numerics and image suites write the stage rows beside a failing gate (the mutant), and
    none on the correct target, whose gates pass."""
    code, rows, output = _suite_rows(tmp_path / "mutant", selection, f"parity.suites.dit.mutants:{mutant}")
    assert code != 0, output
    gates = rows[(rows["kind"] == "gate") & (rows["verdict"] == "fail")]
    blamed = rows[rows["metric"] == BLAME_METRIC]
    assert set(blamed["case"]) == set(gates["case"]) and len(blamed) == len(set(gates["case"])), blamed.to_string()
    expected = all_mutants()[f"dit-{mutant.replace('_', '-')}"].stage
    assert set(blamed["site"]) == {expected}, blamed["detail"].tolist()
    assert (rows["metric"] == STAGE_METRIC).any()

    code, rows, output = _suite_rows(tmp_path / "correct", selection, "serving")
    assert code == 0, output
    assert not rows["metric"].isin([BLAME_METRIC, STAGE_METRIC]).any()

"""Third-party-shaped targets, each with a planted stage defect, localised to the exact stage in every mode.

Two example engines written the way engines write models: `examples/engine_target` (vLLM-shaped,
fused-residual layers, forward hooks of its own) and `examples/llama_style_target` (Llama-shaped, no
hooks at all, its own fused-module names, a joint q|k rotary module). Each defect of
`tests.support.stage_defects.DEFECTS` is planted from outside the engine; the numerics suite's
failing case must name the stage the defect sits in, in eager, cpu_graph and compiled
(docs/localise.md). Compiled was the mode that named the wrong stage: Dynamo reused the suite's
graph, traced without the stage taps, so a target without hooks of its own recorded almost nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

import parity.suites.ar.localise as ar_localise
from parity.localise.observe import Recorded, unobserved_sites
from parity.localise.rows import BLAME_METRIC
from parity.localise.stages import Call, Tap
from parity.observe.compile_ledger import reset_compile_state
from parity.report import read_results
from parity.runners import make_runner
from parity.suites.ar.support import PROMPTS, ARModels, moe_taps
from reference_models.ar.adapter import ReferenceARAdapter
from reference_models.ar.config import ar_config
from reference_models.checkpoints import make_checkpoint
from tests.support import stage_defects
from tests.support.helpers import PROJECT_ROOT, run_pytest

pytestmark = [pytest.mark.parity_cpu, pytest.mark.parity_slow]

MODES = ("eager", "cpu_graph", "compiled")
SELECTION = ("parity/suites/ar/test_numerics.py", "-k", "layer_by_layer and mixed", "-m", "cpu")


def blamed_per_mode(frame: pd.DataFrame) -> dict[str, set[str]]:
    blamed = frame[(frame["metric"] == BLAME_METRIC) & (frame["value"] == 1)]
    return {mode: set(group["site"]) for mode, group in blamed.groupby("mode")}


@pytest.mark.parametrize("defect", list(stage_defects.DEFECTS))
def test_a_planted_defect_is_localised_to_its_stage_in_every_mode(defect: str, tmp_path: Path) -> None:
    factory, stage, what = stage_defects.DEFECTS[defect]
    result = run_pytest(
        [*SELECTION, "-q", "--parity-target", factory, "--parity-report-dir", str(tmp_path), "--parity-run-id", "r"],
        cwd=PROJECT_ROOT,
    )
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    frame = read_results(tmp_path / "r")
    assert blamed_per_mode(frame) == {mode: {stage} for mode in MODES}, (
        what,
        frame[frame["metric"] == BLAME_METRIC][["mode", "site", "detail"]].to_string(),
    )


def test_only_module_taps_that_did_not_fire_count_as_unobserved() -> None:
    """A function stage is recorded in eager runs only, by design: its absence from a compiled run
    is no sign that the graph skipped the taps (else every target with a `Call` would fall back)."""
    value = torch.zeros(1)
    eager = {
        "layer.0.q": Recorded(value, Tap("layers.0.q")),
        "layer.0.q_rope": Recorded(value, Call("engine.kernels:rope")),
        "layer.0.k": None,
    }
    assert unobserved_sites({"layer.0.q": None, "layer.0.q_rope": None}, eager) == ["layer.0.q"]
    assert unobserved_sites({"layer.0.q": Recorded(value, Tap("layers.0.q"))}, eager) == []


def _llama_models(tmp_path: Path) -> ARModels:
    config = ar_config("tiny")
    checkpoint = make_checkpoint("ar", "tiny", 0, tmp_path / "checkpoint")
    target = stage_defects.llama_eps_outside_sqrt().load_ar(checkpoint, "cpu", torch.float32)
    reference = ReferenceARAdapter.load(checkpoint, "cpu", torch.float32)
    golden = ReferenceARAdapter.load(checkpoint, "cpu", torch.float64)
    return ARModels(target, reference, golden, config, "tiny", torch.device("cpu"), torch.float32, checkpoint, 0)


class Rows:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def info(self, **row: Any) -> None:
        self.rows.append(row)

    def blamed(self) -> list[tuple[str, str]]:
        return [(row["site"], row["detail"]) for row in self.rows if row["metric"] == BLAME_METRIC and row["value"] == 1]


def test_a_compiled_graph_that_runs_no_tap_falls_back_to_the_eager_taps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the fresh trace (switched off here), the compiled graph the numerics suite made
    without the stage taps is reused: the localiser sees the taps did not fire and judges the eager
    target's stages. With the fallback switched off too, the chain blames the wrong stage."""
    models = _llama_models(tmp_path)
    (prompt,) = [p for p in PROMPTS if p.name == "mixed"]
    ids = models.ids(prompt.rows)
    reset_compile_state()
    try:
        runner = make_runner("compiled", device="cpu", capture_registry=models.target.capture)
        with runner.prepare(models.target.forward, (ids,), dummy="zeros", taps=moe_taps(models.target), name="forward") as run:
            run(ids)  # the suite's compile, before any failure: no stage taps
        monkeypatch.setattr(ar_localise, "fresh_frame", lambda fn: fn)
        rows = Rows()
        ar_localise.explain_forward(models, ids, "compiled", rows, tmp_path, case="mixed")
        ((site, detail),) = rows.blamed()
        assert site == "layer.0.input_norm" and "stages from the eager target: the compiled graph ran no tap at" in detail

        monkeypatch.setattr(ar_localise, "unobserved_sites", lambda compiled, eager: [])
        rows = Rows()
        ar_localise.explain_forward(models, ids, "compiled", rows, tmp_path, case="mixed")
        assert [site for site, _ in rows.blamed()] != ["layer.0.input_norm"], rows.blamed()
    finally:
        reset_compile_state()

"""The planted catalogue (`parity run --mutants`): mutants planted in any target through the surfaces
of the contract, each with its killing suite and its rule for when it is equivalent on a target.

The entries and their changes are checked on the family's own checkpoint (each changes what it
says and nothing in place), the wrapper on stand-in targets, the verdicts on stand-in rows. The
CPU lane's minimal-target run (`parity run --target examples.minimal_target... --mutants`,
tests/support/shared_run.py) carries the score: at least 12 applicable mutants, at least 90% killed,
each by its own suite, the unmutated target silent under the control seeds. A numerics gate
widened in the mutants' sessions (the switched-off variant) lets the numerics mutants through and
the score drops: the score itself can fail.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from parity.report import mutation_score
from parity.report.page import write_page
from parity.report.review import load_review
from parity.suites.sensitivity import planted as _planted  # noqa: F401 - registers the entries
from parity.suites.sensitivity import runs
from parity.suites.sensitivity.catalogue import LANES, Kill
from parity.suites.sensitivity.plant import (
    EQUIVALENT,
    PLANTED,
    SURFACES,
    Equivalent,
    PlantedTarget,
    kill_verdict,
    not_applicable,
    planted_directory,
    provided_families,
    reference_checkpoint,
    set_config_field,
)
from parity.target import FAMILIES, family_gap
from reference_models.checkpoints import make_checkpoint
from reference_models.common import hf_checkpoint
from reference_models.common.release_layout import read_config_json
from tests.support.helpers import PROJECT_ROOT, run_pytest_here
from tests.support.shared_run import MINIMAL, SharedRun, copy_run

MINIMAL_SPEC = MINIMAL.target


def _suite_of(path: str) -> str:
    found = re.search(r'parity_suite\("(\w+)"\)', (PROJECT_ROOT / path).read_text())
    assert found, path
    return found.group(1)


@pytest.mark.parametrize("name", list(PLANTED))
def test_every_entry_names_its_surface_suite_rule_and_a_selection_of_that_suite(name: str) -> None:
    entry = PLANTED[name]
    assert entry.surface in SURFACES and entry.family in FAMILIES and entry.equivalent_when.strip()
    assert set(entry.lanes) == set(LANES)
    for lane in LANES:
        kill = entry.on(lane)
        if isinstance(kill, Kill):
            assert _suite_of(kill.tests[0]) == entry.suite, (name, lane, kill.tests)
        else:
            assert kill.reason.strip()


def _real(family: str) -> tuple[dict[str, torch.Tensor], object]:
    """The family's tiny random checkpoint as the suites draw it, in memory."""
    if family == "ar":
        from reference_models.ar.config import ar_config
        from reference_models.checkpoints import random_state_dict

        config = ar_config("tiny")
        return random_state_dict(config, 0), config
    from reference_models.dit.checkpoint import random_state_dict as dit_state
    from reference_models.dit.config import config_for_size

    config = config_for_size("tiny")
    return dit_state(config, 0), config


@pytest.mark.parametrize("name", [n for n, e in PLANTED.items() if e.tensors is not None])
def test_a_checkpoint_mutant_changes_tensors_keeps_shapes_and_writes_into_none(name: str) -> None:
    entry = PLANTED[name]
    state, config = _real(entry.family)
    before = {key: tensor.clone() for key, tensor in state.items()}
    planted = dict(state)
    entry.tensors(planted, config)
    assert all(torch.equal(state[key], before[key]) for key in state), "a tensor was written into"
    assert set(planted) == set(state) and all(planted[k].shape == state[k].shape for k in state)
    changed = [key for key in state if not torch.equal(planted[key], state[key])]
    assert changed, f"{name} changed nothing on the family's checkpoint"


@pytest.mark.parametrize("name", [n for n, e in PLANTED.items() if e.config is not None])
def test_a_config_mutant_changes_its_field(name: str) -> None:
    entry = PLANTED[name]
    _, config = _real(entry.family)
    changes = entry.config(config)
    assert changes and all(getattr(config, field) != value for field, value in changes.items())


def test_the_equivalence_rules_say_why() -> None:
    state, config = _real("ar")
    without_bias = {k: v for k, v in state.items() if not k.endswith(".bias")}
    with pytest.raises(Equivalent, match="no attention biases"):
        PLANTED["bias-zeroed"].tensors(dict(without_bias), config)
    zero = dict(state, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    with pytest.raises(Equivalent, match="zero already"):
        PLANTED["bias-zeroed"].tensors(zero, config)
    one_head = SimpleNamespace(num_attention_heads=1, num_key_value_heads=1, head_dim=64)
    with pytest.raises(Equivalent, match="1 attention head"):
        PLANTED["q-heads-permuted"].tensors(dict(state), one_head)
    with pytest.raises(Equivalent, match="1 key/value head"):
        PLANTED["kv-heads-permuted"].tensors(dict(state), one_head)
    no_moe = {k: v for k, v in state.items() if ".gen_mlp." not in k}
    with pytest.raises(Equivalent, match="no layer has a gen expert"):
        PLANTED["und-gen-experts-swapped"].tensors(no_moe, config)
    with pytest.raises(Equivalent, match="holds no 'rope_theta'"):
        set_config_field({"vocab_size": 8}, "rope_theta", 1.0)
    # before any session: a family the target leaves out, a lane where the entry is equivalent
    assert "provides no router" in not_applicable(PLANTED["router-valid-rows-ignored"], "cpu", frozenset({"ar"}))
    assert "cuda lane" in not_applicable(PLANTED["capture-probe-dropped"], "cuda", frozenset({"ar"}))
    assert not_applicable(PLANTED["bias-zeroed"], "cpu", frozenset({"ar"})) is None
    assert set(reference_checkpoint("ar", "tiny")[0]) >= set(state)


def test_a_release_directory_is_planted_under_its_own_names(tmp_path: Path) -> None:
    """The transformed copy keeps the directory's layout: release names and the nested config."""
    source = make_checkpoint("ar", "tiny", 0, tmp_path / "release", layout="release")
    out, changed = planted_directory(PLANTED["gate-up-swapped"], source)
    before, after = hf_checkpoint.load_state_dict(source), hf_checkpoint.load_state_dict(out)
    assert set(before) == set(after)
    differing = sorted(name for name in before if not torch.equal(before[name], after[name]))
    prefix = "llm_model.model.language_model.layers.0.mlp."
    assert differing == [f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"] and changed == {}
    out, changed = planted_directory(PLANTED["rope-theta-changed"], source)
    assert changed == {"rope_theta": (1_000_000.0, 10000.0)}
    assert re.findall(r'"rope_theta": ([0-9.e+]+)', json.dumps(read_config_json(out))) == ["10000.0"]


class _Adapter:
    def __init__(self, config: object) -> None:
        self.config = config


class _ARTarget:
    """A stand-in AR-only target whose loader ignores config.json's rope_theta."""

    name = "stand-in"
    capture = object()

    def load_ar(self, directory, device, dtype):
        return _Adapter(
            SimpleNamespace(
                rope_theta=1_000_000.0, rms_norm_eps=json.loads((Path(directory) / "config.json").read_text())["rms_norm_eps"]
            )
        )

    def build_ar(self, config, state_dict, device, dtype):
        return _Adapter(config)


def test_the_wrapper_keeps_the_targets_families_and_skips_a_config_field_the_target_does_not_take(tmp_path: Path) -> None:
    inner = _ARTarget()
    wrapped = PlantedTarget(inner, PLANTED["rope-theta-changed"])
    assert family_gap(wrapped, "ar") is None and family_gap(wrapped, "dit") and family_gap(wrapped, "routing")
    assert provided_families(wrapped) == provided_families(inner) == {"ar"}
    assert wrapped.capture is inner.capture
    assert type(PlantedTarget(inner, PLANTED["capture-probe-dropped"]).capture).__name__ == "DroppedProbes"
    directory = make_checkpoint("ar", "tiny", 0, tmp_path / "ckpt")
    with pytest.raises(pytest.skip.Exception, match=f"{EQUIVALENT}.*keeps rope_theta=1000000.0 when given 10000.0"):
        wrapped.load_ar(directory, "cpu", torch.float32)
    taken = PlantedTarget(inner, PLANTED["norm-eps-changed"]).load_ar(directory, "cpu", torch.float32)
    assert taken.config.rms_norm_eps == pytest.approx(1e-5)  # this field it takes: the mutant stands


def _rows(*rows: dict) -> pd.DataFrame:
    base = {
        "suite": "numerics",
        "case": "c",
        "mode": "eager",
        "kind": "gate",
        "metric": "rmse_vs_golden",
        "value": 1.0,
        "detail": "",
    }
    return pd.DataFrame([{**base, **row} for row in rows])


def test_the_verdict_of_a_session() -> None:
    entry = PLANTED["bias-zeroed"]
    assert kill_verdict(entry, 1, _rows({"verdict": "fail"}), "", "cpu lane").verdict == "pass"
    # the session failed, but no gate row of the mutant's suite did: a survivor
    other = _rows({"verdict": "fail", "suite": "decode"}, {"verdict": "pass"})
    survived = kill_verdict(entry, 1, other, "tail", "cpu lane")
    assert survived.verdict == "fail" and "SURVIVED" in survived.detail and entry.equivalent_when in survived.detail
    assert kill_verdict(entry, 0, _rows({"verdict": "pass"}), "", "cpu lane").verdict == "fail"
    assert kill_verdict(entry, 5, None, "no tests", "cpu lane").verdict == "fail"
    # every test of the selection skipped on this target: not applicable, with the reasons
    skipped = _rows({"verdict": "skip", "kind": "info", "metric": "skipped", "detail": f"{EQUIVALENT} (bias-zeroed): no bias"})
    verdict = kill_verdict(entry, 0, skipped, "", "cpu lane")
    assert verdict.verdict == "not_applicable" and "no bias" in verdict.detail
    # an error of the planting itself kills nothing
    broken = _rows({"verdict": "error", "metric": "exception", "detail": "setup failed: PlantingError: planting x failed"})
    assert kill_verdict(entry, 1, broken, "", "cpu lane").verdict == "error"


# ---------------------------------------------------------------------------------------------
# The score on the minimal target (the CPU lane's shared run)
# ---------------------------------------------------------------------------------------------


def _planted_rows(run: SharedRun) -> pd.DataFrame:
    rows = run.rows
    return rows[(rows["suite"] == "target_mutants") & (rows["metric"] == "killed")]


@pytest.mark.parity_slow
def test_the_minimal_targets_score(minimal_run: SharedRun, tmp_path: Path) -> None:
    assert minimal_run.returncode == 0, minimal_run.stdout[-3000:]
    score = mutation_score(minimal_run.rows, planted_on="minimal-ar")
    assert score is not None and score.applicable >= 12 and score.killed / score.applicable >= 0.9, score.line()
    assert score.line() in minimal_run.stdout and score.line().startswith("mutation score on minimal-ar: ")
    rows = _planted_rows(minimal_run)
    assert sorted(rows["case"]) == sorted(PLANTED)  # every entry has its row
    killed = rows[rows["verdict"] == "pass"]
    for row in killed.itertuples():  # each killed by a failing row of its own suite
        assert f"by {PLANTED[row.case].suite}/" in row.detail and row.mode == PLANTED[row.case].suite, row.detail
    for row in rows[rows["verdict"] == "fail"].itertuples():  # a survivor says why
        assert "SURVIVED" in row.detail and "equivalent only when" in row.detail
    na = rows[rows["verdict"] == "not_applicable"]
    assert set(na["case"]) >= {"router-valid-rows-ignored", "dit-adaln-chunks-swapped"}  # AR only
    controls = minimal_run.rows[minimal_run.rows["case"].str.startswith("unmutated-target-seed-")]
    assert len(controls) == len(runs.CONTROL_SEEDS) and (controls["verdict"] == "pass").all()
    page = write_page(load_review(copy_run(minimal_run.run_dir, tmp_path / "run"), use_default_baseline=False)).read_text()
    assert 'id="target-mutants-table"' in page and "mutation score on minimal-ar: " in page


def widen_numerics() -> None:
    """The switched-off variant, preloaded in the mutants' fork server: the AR numerics gate
    (`judge`) with a bound a trillion times the noise floor's."""
    from parity.compare import golden_noise_rule
    from parity.suites.ar import support

    def judge(candidate, reference, golden, *, name):
        verdict, _ = golden_noise_rule(golden, reference, candidate, multiplier=1e12, name=name, reason="widened on purpose")
        return verdict

    support.judge = judge


@pytest.mark.parity_slow
def test_a_widened_numerics_gate_lowers_the_score(
    minimal_run: SharedRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The numerics mutants' sessions again, on a fork server that widened the numerics gate before
    any session: they survive, and the score of the run with their rows so drops by as many."""
    numerics = [name for name, entry in PLANTED.items() if entry.suite == "numerics" and entry.family == "ar"]
    monkeypatch.setattr(runs, "PRELOAD", (*runs.PRELOAD, f"{__name__}:widen_numerics"))
    monkeypatch.setenv("PARITY_SENSITIVITY_JOBS", "1")
    settings = SimpleNamespace(
        device="cpu", target=MINIMAL_SPEC, size="tiny", dtype="fp32", tp=1, seed=0, checkpoint_layout="parity"
    )
    with runs.ChildSessions.open(settings, 1, families=frozenset({"ar"})) as children:
        sessions = {name: children.planted_session(name, tmp_path / name) for name in numerics}
        children.start_batches(list(sessions.values()))
        verdicts = {
            name: kill_verdict(PLANTED[name], *children.result(session), "cpu lane") for name, session in sessions.items()
        }
    assert {name: v.verdict for name, v in verdicts.items()} == dict.fromkeys(numerics, "fail")
    rows = minimal_run.rows.copy()
    widened = (rows["suite"] == "target_mutants") & (rows["metric"] == "killed") & rows["case"].isin(numerics)
    rows.loc[widened, "verdict"] = "fail"
    before = mutation_score(minimal_run.rows, planted_on="minimal-ar")
    after = mutation_score(rows, planted_on="minimal-ar")
    assert after.killed == before.killed - len(numerics) and after.applicable == before.applicable
    assert all(name in after.survivors for name in numerics) and "SURVIVED" in after.line()


@pytest.mark.parity_slow
@pytest.mark.parametrize(
    "args, planted",
    [([], False), (["--parity-suite", "numerics", "--parity-mutants"], True), (["--parity-suite", "target_mutants"], True)],
    ids=["default", "suite-and-mutants", "suite-target-mutants"],
)
def test_the_planted_catalogue_runs_only_when_asked(args: list[str], planted: bool, tmp_path: Path) -> None:
    """Left out silently without `--parity-mutants` (as the benchmarks are without their marker: no
    row), kept beside a `--parity-suite` selection with it, and asked for by its suite's name too
    (`--parity-mutants` alone: the minimal target's shared run)."""
    files = [str(PROJECT_ROOT / "parity/suites" / name) for name in ("ar/test_numerics.py", "sensitivity/test_target_mutants.py")]
    code, out = run_pytest_here(
        [*files, "--co", "-q", "--parity-report-dir", str(tmp_path / "r"), *args], basetemp=tmp_path / "t"
    )
    assert code == 0, out[-2000:]
    assert ("test_target_mutants.py::test_planted_mutant_is_killed" in out) == planted, out[-2000:]
    assert ("test_numerics.py::" in out) == ("target_mutants" not in args), out[-2000:]

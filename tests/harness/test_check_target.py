"""`parity check-target` and the conformance check `parity run` makes first (parity/conformance.py).

Each check of the contract is shown going red on a target that breaks it: a missing member, a bare
tuple where an object with `.logits` is required, the wrong number of hidden states, a weight map
that misses checkpoint tensors, an unknown engine policy, half a family, a mask-keyed decode graph
member that answers a key nobody declared.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from parity.cli import main
from parity.conformance import check_target
from parity.report import read_results
from parity.suites.ar.support import moe_observation
from tests.support.helpers import PROJECT_ROOT, run_pytest

pytestmark = pytest.mark.parity_cpu

EXAMPLE = "examples.engine_target.parity_target:make_target"


def test_check_target_lists_families_and_suites_of_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    """`parity check-target` in this process: it resolves and probes the target, as the in-process
    tests below do, and changes nothing process-wide (no fresh interpreter: about 8 s less)."""
    code = main(["check-target", EXAMPLE])
    result = capsys.readouterr()
    assert code == 0, result.err
    out = result.out
    assert "AR: ok (load_ar, build_ar)" in out
    assert "moe site 2: fused-residual (out, residual) taps" in out
    assert "DiT: skip: the target provides no DiT (load_dit / build_dit absent)" in out
    assert "routing: skip: the target provides no routing (router absent)" in out
    assert "eager_fast_path: the engine runs the graph-safe blend in eager too" in out
    plan = {line.split()[0]: line.split()[1] for line in out.split("suites:\n")[1].splitlines()}
    assert plan["expert_selection"] == "run" and plan["routing"] == "skip" and plan["image"] == "skip"


def test_a_missing_member_is_one_line_naming_it_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check-target", "tests.support.example_target_variants:make_target_without_greedy_generate"])
    result = capsys.readouterr()
    assert code == 1
    assert result.err.strip().splitlines() == [
        "parity check-target: AR adapter (Incomplete) lacks ARAdapter member: greedy_generate"
    ]
    assert "Traceback" not in result.out + result.err


def _pytest_must_not_start(argv: list[str]) -> int:
    raise AssertionError(f"parity run started pytest ({' '.join(argv)}): the conformance check did not stop it")


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_parity_run_stops_with_one_line_before_any_suite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`parity run` in this process: the check it starts runs in a process of its own as always,
    and a conforming-looking target would reach `pytest.main`, which fails this test here instead
    of running the suite inside this one."""
    monkeypatch.chdir(PROJECT_ROOT)  # the check's `python -m parity` imports the target's module from here
    monkeypatch.setattr("pytest.main", _pytest_must_not_start)
    spec = "tests.support.example_target_variants:make_target_without_greedy_generate"
    code = main(["run", "--target", spec, "--suite", "numerics", "--report-dir", str(tmp_path)])
    result = capsys.readouterr()
    assert code == 1
    (line,) = [ln for ln in result.err.splitlines() if ln.strip()]
    assert line == (
        f"parity run: target {spec} does not conform (parity check-target {spec}): "
        "AR adapter (Incomplete) lacks ARAdapter member: greedy_generate"
    )
    assert not any(tmp_path.iterdir())  # no run directory: nothing ran


# ---------------------------------------------------------------------------------------------
# In process: each contract check on a target that breaks it
# ---------------------------------------------------------------------------------------------


def broken_target(**replace: Callable[..., Any]) -> Any:
    """The example target whose AR adapter has the given members replaced (called with the adapter)."""
    from examples.engine_target.parity_target import EngineTarget

    class Broken(EngineTarget):
        def _patch(self, adapter: Any) -> Any:
            for name, make in replace.items():
                setattr(adapter, name, make(adapter))
            return adapter

        def load_ar(self, checkpoint_dir, device, dtype):
            return self._patch(super().load_ar(checkpoint_dir, device, dtype))

        def build_ar(self, config, state_dict, device, dtype):
            return self._patch(super().build_ar(config, state_dict, device, dtype))

    return Broken()


def ar_problems(target: Any) -> list[str]:
    result = check_target(target, "broken", suites=["numerics"])
    return [p for f in result.families for p in f.problems] + result.problems


def test_the_example_conforms_in_process() -> None:
    assert ar_problems(broken_target()) == []


def test_forward_returning_a_bare_tuple_is_named() -> None:
    def bare(adapter):
        original = adapter.forward
        return lambda *a, **k: tuple(original(*a, **k))

    (first, *_) = ar_problems(broken_target(forward=bare))
    assert (
        "forward(ids) must return an object with .logits [1, 6, 320] (a dataclass or NamedTuple), got tuple without .logits"
        in first
    )


def test_hidden_states_must_be_one_per_layer() -> None:
    def last_only(adapter):
        original = adapter.forward
        return lambda *a, **k: original(*a, **k)._replace(hidden_states=original(*a, **k).hidden_states[-1:])

    problems = ar_problems(broken_target(forward=last_only))
    assert any("forward(ids).hidden_states must hold 4 tensors [1, 6, 64]" in p for p in problems), problems


def test_a_weight_map_that_misses_tensors_is_no_contract_error() -> None:
    """A tensor the map leaves out is a loader finding for weight_coverage (its rows name it, the run
    goes on: tests/suites/test_weight_coverage_values.py), not a reason to stop before any row."""

    def partial(adapter):
        names = adapter.weight_name_map()
        return lambda: {k: v for k, v in names.items() if "gen_mlp" not in k}

    assert not any("weight_name_map()" in p for p in ar_problems(broken_target(weight_name_map=partial)))


def test_a_weight_map_naming_tensors_the_checkpoint_lacks_is_named() -> None:
    def misspelt(adapter):
        names = adapter.weight_name_map()
        return lambda: {k: [n.replace("model.", "module.", 1) for n in v] for k, v in names.items()}

    problems = ar_problems(broken_target(weight_name_map=misspelt))
    assert any(
        "weight_name_map() must spell checkpoint tensors as in the directory: unknown" in p and "module." in p for p in problems
    )


def test_decode_step_of_the_wrong_shape_is_named() -> None:
    def wide(adapter):
        original = adapter.decode_step
        return lambda ids, positions: original(ids, positions)[:, None]

    problems = ar_problems(broken_target(decode_step=wide))
    assert any("decode_step(ids [1, 1], positions [1]) must return [1, 320], got Tensor [1, 1, 320]" in p for p in problems)


def test_unknown_engine_policy_and_half_a_family_are_problems() -> None:
    from examples.engine_target.parity_target import EngineTarget

    class Typo(EngineTarget):
        not_applicable = {"eager_fastpath": "typo"}

    assert any("unknown engine policy 'eager_fastpath'" in p for p in check_target(Typo(), "typo", suites=["x"]).problems)

    class Half:
        name = "half"
        capture = EngineTarget.capture

        def load_dit(self, *args):  # no build_dit
            raise AssertionError("never probed")

    result = check_target(Half(), "half", suites=["image"])
    (dit,) = [f for f in result.families if f.family.name == "DiT"]
    assert dit.problems == ["target half has load_dit but lacks DiT member: build_dit"]


def test_moe_observation_reads_both_forms_and_refuses_a_mix() -> None:
    from parity.observe.taps import TapCall

    x, h, moe = torch.ones(1, 2, 4), torch.full((1, 2, 4), 2.0), torch.full((1, 2, 4), 3.0)
    plain = moe_observation(TapCall(h, x), TapCall(None, h + moe), layer=2)
    fused = moe_observation(TapCall(x, (x, h)), TapCall(None, (moe, h)), layer=2)
    assert plain[3] is True and torch.equal(plain[1], h) and torch.equal(plain[2], h + moe)
    assert fused[3] is False and torch.equal(fused[1], h) and torch.equal(fused[2], moe)
    with pytest.raises(TypeError, match="MoE layer 2: pre_norm returned tuple, layer_module Tensor"):
        moe_observation(TapCall(x, (x, h)), TapCall(None, h + moe), layer=2)


# ---------------------------------------------------------------------------------------------
# Mask-keyed decode graphs (docs/targets.md §3.2): check-target calls the three members
# ---------------------------------------------------------------------------------------------

KEYS = ("und_only", "blend")


def keyed_target(**replace: Callable[..., Any]) -> Any:
    """The example with two declared decode graphs whose members accept every key; `replace`
    overrides some of them (each called with the adapter, as in `broken_target`)."""
    members: dict[str, Callable[..., Any]] = {
        "decode_graph_keys": lambda adapter: KEYS,
        "select_decode_graph": lambda adapter: lambda key: None,
        "decode_graph_key": lambda adapter: lambda generating: "und_only" if generating and not any(generating) else "blend",
    }
    return broken_target(**(members | replace))


def test_keyed_decode_members_of_a_conforming_target_pass() -> None:
    assert ar_problems(keyed_target()) == []


@pytest.mark.parametrize(
    ("replace", "line"),
    [
        (
            {"decode_graph_key": lambda adapter: lambda generating: "both"},
            "decode_graph_key(generating) must answer one of decode_graph_keys ('und_only', 'blend'): returned 'both' for "
            "[False, False] (all text), 'both' for [True, True] (all gen), 'both' for [False, True] (mixed), 'both' for "
            "[None, False] (a row of unknown kind)",
        ),
        (
            {"decode_graph_key": lambda adapter: lambda generating: "blend" if None in generating else None},
            "decode_graph_key(generating) must answer one of decode_graph_keys ('und_only', 'blend'): returned None for "
            "[False, False] (all text), None for [True, True] (all gen), None for [False, True] (mixed)",
        ),
        (
            {"select_decode_graph": lambda adapter: lambda key: {"blend": None}[key]},
            "select_decode_graph('und_only') raised KeyError: 'und_only'",
        ),
        (
            {"select_decode_graph": lambda adapter: None},
            "declares decode_graph_keys ('und_only', 'blend') but lacks select_decode_graph",
        ),
        (
            {"decode_graph_keys": lambda adapter: lambda: KEYS},
            "decode_graph_keys must be a tuple of distinct non-empty str keys, got <function",
        ),
        (
            {"decode_step": lambda adapter: lambda ids, positions: torch.zeros(1, 1)},
            "decode_step(ids [1, 1], positions [1]) after select_decode_graph('und_only') must return [1, 320], got Tensor [1, 1]",
        ),
    ],
    ids=["key-not-declared", "key-none", "select-refuses", "select-missing", "keys-a-method", "step-after-select"],
)
def test_keyed_decode_members_are_called_and_a_wrong_answer_is_one_line(replace: dict, line: str) -> None:
    problems = ar_problems(keyed_target(**replace))
    assert [p for p in problems if line in p], problems


def test_without_the_keyed_check_a_key_not_declared_slips_past(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check switched off (check-target as it was): the bad key conforms, and only a run finds it."""
    monkeypatch.setattr("parity.suites.ar.conformance._check_decode_graphs", lambda *args: None)
    assert ar_problems(keyed_target(decode_graph_key=lambda adapter: lambda generating: "both")) == []


def test_a_key_not_declared_in_a_run_is_an_error_row_naming_the_member(tmp_path: Path) -> None:
    """The suites replay the graph of the key `decode_graph_key` answers: one that is no declared key
    is the target's error, named with the member, what it returned and the keys (it used to be a bare
    `KeyError: 'both'`)."""
    args = ["parity/suites/ar/test_expert_selection.py", "-k", "keyed and eager", "-m", "cpu", "-q"]
    target = "tests.support.slippery_targets:graph_key_not_declared"
    result = run_pytest(
        [*args, "--parity-target", target, "--parity-report-dir", str(tmp_path), "--parity-run-id", "r"], cwd=PROJECT_ROOT
    )
    assert result.returncode == 1, result.stdout[-3000:]
    errors = read_results(tmp_path / "r").query("verdict == 'error'")
    assert (
        len(errors) >= 1
        and errors["detail"]
        .str.contains(
            "decode_graph_key([False]) returned 'both': expected one of its decode_graph_keys ('und_only', 'gen_only', 'blend')",
            regex=False,
        )
        .all()
    ), errors["detail"].tolist()

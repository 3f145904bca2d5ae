"""The localiser's own rules, on values and modules built here (docs/localise.md).

Each rule has a case where it must fire: an unknown stage or a missing module in a stage map is a
line naming it; a stage that only inherits its input's error is not blamed; a stage the target does
not declare is reported not observable and named in the summary, never skipped silently; the
compile-only bisection names the smallest piece whose compiled output differs, not its parent or a
child; a repro directory runs on its own, in another directory, in seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from parity.localise.bisect import bisect_compiled
from parity.localise.chain import FAIL, NOT_OBSERVABLE, PASS, Side, build_chain
from parity.localise.observe import Recorded, missing_paths, resolve
from parity.localise.repro import StageSource, write_repro
from parity.localise.stages import Stage, Tap, Vocabulary, map_problems
from parity.localise.vocabulary import vocabulary
from tests.support.helpers import run_command

pytestmark = pytest.mark.parity_cpu

TOY = Vocabulary(
    "toy",
    (
        Stage("a", "first linear"),
        Stage("b", "second linear", ("a",)),
        Stage("c", "third linear", ("b",)),
    ),
    entry="a",
)


class Toy(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def _sides(target: Toy, reference: Toy, declared: dict) -> tuple:
    golden = Toy()
    golden.load_state_dict(reference.state_dict())
    golden = golden.double()
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    full = {name: Tap(name) for name in "abc"}
    maps = [resolve(m, stage_map, TOY, 0) for m, stage_map in ((target, declared), (reference, full), (golden, full))]
    values = []
    for module, resolved, inputs in zip((target, reference, golden), maps, (x, x, x.double())):
        from parity.localise.observe import observe_eager

        values.append(observe_eager(module, resolved, lambda m=module, i=inputs: m(i))[1])
    return maps, values


def _chain(target: Toy, reference: Toy, declared: dict):
    (tmap, rmap, _), (tv, rv, gv) = _sides(target, reference, declared)
    return build_chain(
        TOY, target_map=tmap, reference_map=rmap, target=Side(tv), reference=Side(rv), golden=Side(gv), compared="toy"
    )


def _broken_at(stage: str) -> tuple[Toy, Toy]:
    reference, target = Toy(), Toy()
    with torch.no_grad():
        getattr(target, stage).bias += 0.1
    return target, reference


def test_a_stage_that_only_inherits_error_is_not_blamed() -> None:
    target, reference = _broken_at("b")
    chain = _chain(target, reference, {name: Tap(name) for name in "abc"})
    status = {s.site: s.status for s in chain.stages}
    assert status == {"a": PASS, "b": FAIL, "c": FAIL}  # c is out of bound too, by inheritance
    assert chain.blamed is not None and chain.blamed.site == "b"
    assert "while its inputs were within bound (a " in chain.summary()


def test_a_correct_target_blames_nothing() -> None:
    reference = Toy()
    chain = _chain(Toy(), reference, {name: Tap(name) for name in "abc"})
    assert chain.blamed is None and all(s.status == PASS for s in chain.stages)


def test_an_undeclared_stage_is_not_observable_and_named_in_the_summary() -> None:
    target, reference = _broken_at("b")
    chain = _chain(target, reference, {"a": Tap("a"), "c": Tap("c")})
    assert chain.stage("b").status == NOT_OBSERVABLE
    assert chain.blamed is not None and chain.blamed.site == "c"  # the first observable divergence
    assert "b between them not observable" in chain.summary()


def test_stage_map_problems_are_one_line_each() -> None:
    ar = vocabulary("ar")
    problems = map_problems(
        ar,
        {
            "layer.{layer}.qq": "x",  # unknown stage
            "layer.{layer}.q": {"module": "a", "function": "b:c"},  # both kinds
            "layer.{layer}.k": {"module": "a", "layout": "rows"},  # unknown layout
            "layer.{layer}.v": {"module": "a", "bogus": 1},  # unknown option
        },
        who="M.stage_map",
    )
    assert len(problems) == 4, problems
    for expected in (
        "unknown stage 'layer.{layer}.qq'",
        "exactly one of 'module' or 'function'",
        "layout 'rows'",
        "unknown key 'bogus'",
    ):
        assert sum(expected in line for line in problems) == 1, (expected, problems)
    missing = missing_paths(Toy(), {"a": "a", "b": "nope.linear", "c": {"function": "no_such_module:f"}}, 0, who="M.stage_map")
    assert missing == [
        "M.stage_map: stage_map['b'] names module 'nope.linear', which the model does not have",
        "M.stage_map: stage_map['c'] names function 'no_such_module:f', which cannot be imported",
    ]


def test_stage_map_problems_come_all_at_once_with_the_nearest_valid_names() -> None:
    """Every problem in one check (a misspelt stage, a misspelt option and a module the model lacks
    together), each unknown name with its nearest valid ones, not the whole vocabulary."""
    from parity.localise.validate import stage_map_report

    class Adapter:
        module = Toy()
        stage_map = {
            "layer.{layer}.inputnorm": "a",
            "layer.{layer}.q": {"module": "a", "outptu": 0},
            "layer.{layer}.k": "bb",
            "layer.{layer}.v": {"module": "c", "layout": "head"},
        }

    problems, _ = stage_map_report(Adapter(), "ar", 0)
    assert len(problems) == 4, problems
    for expected in (
        "unknown stage 'layer.{layer}.inputnorm' (did you mean 'layer.{layer}.input_norm'",
        "unknown key 'outptu' (did you mean 'output'?)",
        "layout 'head' is not one of tokens, heads, heads_first (did you mean 'heads'",
        "names module 'bb', which the model does not have (did you mean 'b'?)",
    ):
        assert sum(expected in line for line in problems) == 1, (expected, problems)
    assert not any("layer.{layer}.gen_mlp.down" in line for line in problems)  # the vocabulary is not listed


class _CompileOnly(nn.Module):
    """Right in eager; under a compiler it adds a constant (a compile-only path gone wrong)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y + 0.05 if torch.compiler.is_compiling() else y


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.before, self.piece, self.after = nn.Linear(8, 8), _CompileOnly(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after(self.piece(self.before(x)))


def test_bisection_names_the_smallest_piece_whose_compiled_output_differs() -> None:
    model = _Outer()
    x = torch.randn(4, 8)
    result = bisect_compiled(model, lambda: model(x), backend="eager")
    assert result.piece is not None and result.piece.path == "piece", result.summary()
    tried = {p.path: p.differs for p in result.tried}
    assert tried["piece.inner"] is False and tried["before"] is False  # neither a child nor a sibling
    assert result.summary().startswith("compiled piece differs from the same module run eagerly")


def test_bisection_finds_nothing_in_a_correct_model() -> None:
    model = _Outer()
    model.piece.__class__ = type("Plain", (nn.Module,), {"forward": lambda self, x: self.inner(x)})
    x = torch.randn(4, 8)
    assert bisect_compiled(model, lambda: model(x), backend="eager").piece is None


def test_a_repro_runs_on_its_own_in_another_directory(tmp_path: Path) -> None:
    target, reference = _broken_at("b")
    chain = _chain(target, reference, {name: Tap(name) for name in "abc"})
    x = torch.randn(2, 3, 8)
    full = {name: Tap(name) for name in "abc"}
    path = write_repro(
        tmp_path,
        chain,
        case="toy case",
        mode="eager",
        target=StageSource(target, resolve(target, full, TOY, 0), lambda: target(x)),
        reference=StageSource(reference, resolve(reference, full, TOY, 0), lambda: reference(x)),
    )
    assert path == "repro/toy_case-eager/repro.py"
    directory = tmp_path / "repro" / "toy_case-eager"
    assert {p.name for p in directory.iterdir()} == {"repro.py", "calls.json", "inputs.safetensors", "weights.safetensors"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_command([sys.executable, str(directory / "repro.py")], cwd=elsewhere)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "stage b" in result.stdout and "DIVERGED" in result.stdout, result.stdout


def test_recorded_values_carry_their_declaration() -> None:
    model = Toy()
    from parity.localise.observe import observe_eager

    resolved = resolve(model, {"a": Tap("a"), "b": {"module": "b", "input": True}}, TOY, 0)
    _, values = observe_eager(model, resolved, lambda: model(torch.randn(1, 8)))
    assert isinstance(values["a"], Recorded) and values["a"].where == Tap("a")
    assert torch.equal(values["b"].value, values["a"].value)  # b's input is a's output

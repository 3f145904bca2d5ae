"""Localising a failing routing case names the stage each routing mutant breaks, and nothing on the
correct router.

Each mutant is applied in-process (`parity.suites.routing.mutants` patches one function of
`serving_models.routing.router`; the fixture puts every function back), the case its kill
selection runs is checked, and `parity.suites.routing.localise.explain` must write the chain with
the catalogue's `stage` as the blamed site. The count read on the host is right in eager, which is
all function taps see: its chain blames nothing (the catalogue's `stage_note` says so).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import parity.suites.routing.cases as cases
import parity.suites.routing.localise as localise
import parity.suites.routing.support as support
from parity.localise.chain import NOT_OBSERVABLE, PASS
from parity.localise.rows import BLAME_METRIC
from parity.suites.sensitivity.catalogue import all_mutants
from serving_models.routing import router as serving_routing
from serving_models.routing.adapter import ServingRouter

pytestmark = pytest.mark.parity_cpu

CPU = torch.device("cpu")
SEED = 1


class RowCatcher:
    """The `info` half of the report fixture: the rows a localisation writes."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def info(self, **row: Any) -> None:
        self.rows.append(row)


def _edge(name: str) -> cases.EdgeCase:
    return next(case for case in cases.CASES["edge"] if case.name == name)


GRID_GROUPED = support.GridPoint("grouped", 64, 8, 64, "fp32", True)
GRID_SOFTMAX = support.GridPoint("softmax", 64, 8, 64, "fp32", True)
PAD = support.PadPoint("grouped", "T-1", "garbage")
TIE = _edge("tie-plateau-E16-k4")

# case -> (its gate rows on a router, its call, its name): the cases the mutants' kill selections run
CASES: dict[str, tuple[Callable[[Any], list], Callable[[], localise.RouteCall], str]] = {
    "grid-grouped": (
        lambda router: support.grid_rows(router, GRID_GROUPED, CPU, SEED),
        lambda: localise.grid_call(GRID_GROUPED, CPU, SEED),
        GRID_GROUPED.name,
    ),
    "grid-softmax": (
        lambda router: support.grid_rows(router, GRID_SOFTMAX, CPU, SEED),
        lambda: localise.grid_call(GRID_SOFTMAX, CPU, SEED),
        GRID_SOFTMAX.name,
    ),
    "pad": (
        lambda router: support.pad_rows(router, PAD, CPU, SEED),
        lambda: localise.pad_call(PAD, CPU, SEED),
        PAD.name(cases.CASES["pad"].rows),
    ),
    "tie": (
        lambda router: support.edge_rows(router, TIE, "fp32", CPU),
        lambda: localise.edge_call(TIE, "fp32", CPU),
        f"{TIE.name}-fp32",
    ),
}

MUTANT_CASES = {
    "router-ignores-num-valid-rows": "pad",
    "router-ties-to-highest-id": "tie",
    "router-group-score-max-with-bias": "grid-grouped",
    "router-renormalize-ignored": "grid-softmax",
}


@pytest.fixture
def mutate() -> Iterator[Callable[[str], Any]]:
    """Apply a routing mutant by catalogue name, returning its router; every function of the
    serving router module is put back afterwards."""
    saved = {name: value for name, value in vars(serving_routing).items() if callable(value)}

    def apply(name: str) -> Any:
        module, _, factory = all_mutants()[name].target.partition(":")
        return getattr(importlib.import_module(module), factory)().router()

    yield apply
    for name, value in saved.items():
        setattr(serving_routing, name, value)


def test_every_routing_mutant_declares_a_stage_or_says_why_not() -> None:
    routing = {name: m for name, m in all_mutants().items() if m.suite == "routing"}
    assert routing and set(MUTANT_CASES) <= set(routing)
    for name, mutant in routing.items():
        assert mutant.stage or mutant.stage_note, name  # a stage, or why none (a stage with a note: a known miss)
        if mutant.stage:
            assert mutant.stage in localise.VOCABULARY.names, (name, mutant.stage)


@pytest.mark.parametrize("name", sorted(MUTANT_CASES))
def test_a_mutants_failing_case_names_its_stage(name: str, mutate) -> None:
    router = mutate(name)
    gate, call, case = CASES[MUTANT_CASES[name]]
    rows = gate(router)
    assert any(row.failed for row in rows), f"{name} must fail its case {case}"
    report = RowCatcher()
    chain = localise.explain(report, rows, router, call, case=case, seed=SEED)
    expected = all_mutants()[name].stage
    assert chain is not None and chain.blamed is not None and chain.blamed.site == expected, chain and chain.summary()
    [blame] = [row for row in report.rows if row["metric"] == BLAME_METRIC]
    assert (blame["site"], blame["verdict"], blame["case"], blame["seed"]) == (expected, "fail", case, SEED)
    before = localise.VOCABULARY.names[: localise.VOCABULARY.names.index(expected)]
    assert all(chain.stage(site) is None or chain.stage(site).status == PASS for site in before), chain.stages


@pytest.mark.parametrize("key", sorted(CASES))
def test_the_correct_router_blames_nothing_and_writes_no_rows(key: str) -> None:
    gate, call, case = CASES[key]
    rows = gate(ServingRouter())
    assert not any(row.failed for row in rows)
    report = RowCatcher()
    assert localise.explain(report, rows, ServingRouter(), call, case=case) is None and report.rows == []
    chain = localise.localise_call(ServingRouter(), call(), compared=case)
    assert chain.blamed is None and {stage.status for stage in chain.stages} == {PASS}, chain.stages
    assert {stage.site for stage in chain.stages} >= {"scores", "keys", "topk_ids", "weights", "masked_ids", "masked_weights"}


def test_a_tie_between_groups_shows_at_the_group_mask(mutate) -> None:
    """The tie rule orders groups too: the ties mutant's group-tie cases (left out of its kill
    selection, which names topk_ids) diverge one stage earlier."""
    router = mutate("router-ties-to-highest-id")
    case = _edge("tie-between-groups-lower-group-E8-k2")
    call = localise.edge_call(case, "fp32", CPU)
    assert localise.localise_call(router, call, compared=case.name).blamed.site == "group_mask"
    assert "between-groups" in all_mutants()["router-ties-to-highest-id"].tests[-1]


def test_a_count_read_on_the_host_is_right_in_eager_so_no_stage_is_blamed(mutate) -> None:
    router = mutate("router-reads-count-on-host")
    _, call, case = CASES["pad"]
    assert all_mutants()["router-reads-count-on-host"].stage_note
    assert localise.localise_call(router, call(), compared=case).blamed is None


class WithoutStages(ServingRouter):
    """The serving router with some stages left out of its map (or no map at all)."""

    def __init__(self, left_out: tuple[str, ...] | None) -> None:
        self.stage_map = None if left_out is None else {k: v for k, v in ServingRouter.stage_map.items() if k not in left_out}


def test_a_stage_the_map_leaves_out_is_not_observable_and_blame_moves_past_it(mutate) -> None:
    mutate("router-renormalize-ignored")
    _, call, case = CASES["grid-softmax"]
    chain = localise.localise_call(WithoutStages(("weights",)), call(), compared=case)
    assert chain.stage("weights").status == NOT_OBSERVABLE
    # masked_weights reads the weights, which are not observable: its inputs are theirs, within bound
    assert chain.blamed is not None and chain.blamed.site == "masked_weights"
    assert set(chain.blamed.inputs) == {"scores", "topk_ids"}
    chain = localise.localise_call(WithoutStages(None), call(), compared=case)
    assert chain.blamed is None and {stage.status for stage in chain.stages} == {NOT_OBSERVABLE}

"""Grouped routing with groups of one expert and a correction bias (docs/routing.md §3).

No group of one has two keys, so the sum-of-two group score is -inf everywhere and the kept groups
would be the lowest ids: E 8, G 8, topk_group 4, k 2 chose experts [0, 1] whatever the logits.
Both routers refuse it with one line; the suite's `refuse-` check passes a refusal and vLLM's
ungrouped fallback and fails a router that picks experts by group id (the defect, rebuilt here).
"""

from __future__ import annotations

import math

import pytest
import torch

from parity.cases import CaseFileError
from parity.compare import FAIL, PASS
from parity.suites.routing import cases as routing_cases
from parity.suites.routing.support import refuse_rows
from reference_models.routing import router as reference
from serving_models.routing import router as serving
from serving_models.routing.adapter import ServingRouter

LOGITS = torch.tensor([[0.5, -1.0, 3.0, 0.0, 2.5, -2.0, 1.0, 0.25]])
BIAS = -torch.rand(8, generator=torch.Generator().manual_seed(0)) - 1.0
GROUPED = dict(scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=4, correction_bias=BIAS)


@pytest.mark.parametrize("select", [reference.select_experts, serving.select_experts], ids=["reference", "serving"])
def test_both_routers_refuse_groups_of_one_with_a_bias(select) -> None:
    with pytest.raises(ValueError, match=r"num_expert_group=8 splits E=8 into groups of one expert") as info:
        select(LOGITS, 2, **GROUPED)
    assert "\n" not in str(info.value) and "num_expert_group=None" in str(info.value)


def test_groups_of_one_without_a_bias_route_as_ungrouped_in_both() -> None:
    options = dict(scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=8)
    ids = [f(LOGITS, 2, **options).ids.tolist() for f in (reference.select_experts, serving.select_experts)]
    assert ids == [[[2, 4]], [[2, 4]]]


def _by_group_id(logits: torch.Tensor, k: int, **options) -> serving.RoutingResult:
    """The defect: every group scores -inf, the lowest group ids are kept (the old behaviour)."""
    rows, experts = logits.shape
    keep = torch.zeros(rows, experts, dtype=torch.bool)
    keep[:, : options["topk_group"]] = True
    keys = torch.where(keep, serving.sigmoid_fp32(logits.float()) + options["correction_bias"], torch.tensor(-math.inf))
    ids = torch.topk(keys, k, dim=-1).indices.to(torch.int32)
    return serving.RoutingResult(torch.ones(rows, k), ids)


class _Router(ServingRouter):
    def __init__(self, select) -> None:
        self._select = select

    def select_experts(self, logits, k, **options):
        return self._select(logits, k, **options)


def _verdicts(router) -> list[str]:
    case = routing_cases.CASES["refuse"][0]
    return [row.verdict for row in refuse_rows(router, case, torch.device("cpu"), case.seed)]


def test_the_suite_passes_a_refusal_and_the_ungrouped_fallback() -> None:
    assert _verdicts(ServingRouter()) == [PASS, PASS]

    def fallback(logits, k, **options):  # vLLM's answer: route without groups
        options.pop("num_expert_group"), options.pop("topk_group")
        return serving.select_experts(logits, k, **options)

    assert _verdicts(_Router(fallback)) == [PASS, PASS]


def test_the_suite_fails_experts_chosen_by_group_id() -> None:
    assert _verdicts(_Router(_by_group_id)) == [PASS, FAIL]


def test_the_case_file_refuses_groups_of_one_for_a_biased_kind() -> None:
    cases = dict(routing_cases.CASES)
    groups = routing_cases.Groups("E8-ones", 8, [2], 8, 4, "groups of one")
    cases["groups"] = [g for g in cases["groups"] if g.experts != 8] + [groups]
    with pytest.raises(CaseFileError, match="groups of one expert"):
        routing_cases._check_cross_references(cases)

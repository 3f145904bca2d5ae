"""The `routing` suite's checks go red on broken routers and broken results.

The three routing mutants of the catalogue (an ignored count, ties to the highest id, a count read
on the host) are killed by the sensitivity suite (`parity/suites/sensitivity/test_sensitivity.py`) in fresh
processes. Here: the rank check against a mutant router in spawned ranks, and in-process, every
other check of `parity/suites/routing/support.py` handed a broken router (or broken results) must write a
failing row, and the near-tie audit classifies hand-built decisions as the rule says.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import parity.suites.routing.cases as cases
import parity.suites.routing.ranks as ranks
import parity.suites.routing.support as support
from parity.compare import ERROR, FAIL, PASS, TIE_FLIP
from parity.runners import make_runner
from serving_models.common import capture as serving_capture
from serving_models.routing import router as serving_routing
from serving_models.routing.adapter import ServingRouter
from tests.support.helpers import PROJECT_ROOT

CPU = torch.device("cpu")


@pytest.mark.parity_slow  # two spawned ranks
def test_rank_check_catches_a_router_that_ignores_the_count(tmp_path: Path) -> None:
    spec = cases.CASES["rank"]
    job = ranks.RankJob(
        "parity.suites.routing.mutants:serving_ignores_valid_rows",
        "gloo",
        str(tmp_path / "rendezvous"),
        str(tmp_path),
        spec.seed,
        spec.timeout_s,
    )
    results = ranks.run_ranks(job)
    rows = [row for case, kind in ranks.rank_case_names() for row in ranks.rank_rows(case, kind, results, spec.seed, "gloo")]
    failed = {(row.metric, row.site) for row in rows if row.failed}
    # Routed before the gather, pads keep real routes; gathered first, they are masked afterwards.
    assert ("ids_mismatch", "gather_then_route") in failed and ("ids_mismatch", "reference") in failed, failed


# ---- the near-tie audit -----------------------------------------------------------------------


def audit(values: list[float], ref: list[int], cand: list[int], dtype: torch.dtype, k: int, exact: bool = False, **options):
    logits = torch.tensor([values], dtype=torch.float32).to(dtype)
    options.setdefault("scoring", "softmax")
    return support.audit_decisions(
        logits,
        torch.tensor([ref], dtype=torch.int32),
        torch.tensor([cand], dtype=torch.int32),
        k,
        options,
        spacings=2.0,
        exact=exact,
    )


def test_audit_calls_a_flip_within_two_spacings_a_tie_flip() -> None:
    one_ulp_above_one = 1.0 + 2.0**-7  # the next bf16 value after 1.0
    [decision] = audit([4.0, one_ulp_above_one, 1.0, -3.0], [0, 1], [0, 2], torch.bfloat16, 2)
    assert (decision.where, decision.verdict) == ("k-boundary", TIE_FLIP)
    assert decision.margin_ulps == pytest.approx(1.0)


def test_audit_fails_a_wide_margin_an_exact_tie_and_any_fp32_difference() -> None:
    assert audit([4.0, 2.0, 1.0, -3.0], [0, 1], [0, 2], torch.bfloat16, 2)[0].verdict == FAIL  # 128 ulps
    exact_tie = audit([4.0, 1.0, 1.0, -3.0], [0, 1], [0, 2], torch.bfloat16, 2)[0]
    assert exact_tie.margin == 0.0 and exact_tie.verdict == FAIL  # R3 decides exact ties
    one_fp32_ulp = audit([4.0, 1.0 + 2.0**-23, 1.0, -3.0], [0, 1], [0, 2], torch.float32, 2, exact=True)[0]
    assert one_fp32_ulp.margin_ulps == pytest.approx(1.0) and one_fp32_ulp.verdict == FAIL


def test_audit_judges_an_order_swap_inside_the_set_by_that_slot_margin() -> None:
    [decision] = audit([1.0 + 2.0**-7, 1.0, 0.0, -3.0], [0, 1], [1, 0], torch.bfloat16, 2)
    assert (decision.where, decision.verdict) == ("slot 0", TIE_FLIP)
    [decision] = audit([3.0, 1.0, 0.0, -3.0], [0, 1], [1, 0], torch.bfloat16, 2)
    assert (decision.where, decision.verdict) == ("slot 0", FAIL)


def test_audit_excuses_a_set_change_by_a_near_tie_between_groups() -> None:
    # Groups {0,1} and {2,3} score 2σ(1) vs 2σ(1 + 1 bf16 ulp): 0.4 bf16 spacings apart; the kept
    # group holds exactly k experts, so only the group margin can explain a different set.
    bias = torch.zeros(4)
    [near] = audit(
        [1.0, 1.0, 1.0 + 2.0**-7, 1.0 + 2.0**-7],
        [2, 3],
        [0, 1],
        torch.bfloat16,
        2,
        scoring="sigmoid",
        num_expert_group=2,
        topk_group=1,
        correction_bias=bias,
    )
    assert near.verdict == TIE_FLIP and 0 < near.group_margin_ulps <= 2 and math.isinf(near.margin_ulps)
    [far] = audit(
        [1.0, 1.0, 2.0, 2.0],
        [2, 3],
        [0, 1],
        torch.bfloat16,
        2,
        scoring="sigmoid",
        num_expert_group=2,
        topk_group=1,
        correction_bias=bias,
    )
    assert far.verdict == FAIL


# ---- in-process: each check writes a failing row on a broken router ---------------------------------


class SwappedPair(ServingRouter):
    """Returns (ids, weights): the ROCm/ATOM f0ff38905 bug."""

    def select_experts(self, logits, k, **options):
        weights, ids = super().select_experts(logits, k, **options)
        return ids, weights


class ScaledWeights(ServingRouter):
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def select_experts(self, logits, k, **options):
        result = super().select_experts(logits, k, **options)
        return result._replace(weights=result.weights * self.factor)


class NanToZero(ServingRouter):
    """Non-finite logits clamped to 0 before routing (the vLLM behaviour of docs/routing.md §7)."""

    def select_experts(self, logits, k, **options):
        return super().select_experts(torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=0.0), k, **options)


class BatchShifted(ServingRouter):
    """Shifts every logit by the batch maximum: softmax-equivalent on paper, batch-dependent in bits."""

    def select_experts(self, logits, k, **options):
        shift = torch.nan_to_num(logits.float(), nan=0.0, posinf=0.0, neginf=0.0).amax()
        return super().select_experts(logits.float() - shift, k, **options)


class LoadIgnoresCount(ServingRouter):
    def expert_load(self, ids, num_valid_rows, num_physical):
        return super().expert_load(ids, None, num_physical)


class RemapWithoutGuard(ServingRouter):
    """Checks only the upper bound: -1 indexes the last expert's replicas."""

    def remap(self, ids, replica_table, row_choice):
        table = replica_table.to(torch.int64)
        below_end = ids < table.shape[0]
        safe = torch.where(below_end, ids, torch.zeros_like(ids)).to(torch.int64)
        slot = row_choice.to(torch.int64).unsqueeze(1) % (table >= 0).sum(1)[safe]
        return torch.where(below_end, table[safe, slot].to(ids.dtype), ids)


def gate_verdicts(rows: list[support.Row], metric: str) -> set[str]:
    return {row.verdict for row in rows if row.metric == metric and row.kind == "gate"}


GRID_FP32 = support.GridPoint("grouped", 64, 8, 64, "fp32", True)
GRID_BF16 = support.GridPoint("softmax", 256, 8, 64, "bf16", False)


def test_grid_point_passes_on_the_serving_router() -> None:
    for point in (GRID_FP32, GRID_BF16):
        rows = support.grid_rows(ServingRouter(), point, CPU, seed=1)
        assert not [row for row in rows if row.failed], rows
        assert {row.metric for row in rows} >= {"contract_violations", "ids_mismatch", "weight_max_abs", "rmse_vs_golden"}


def test_grid_catches_a_swapped_pair_and_wrong_weights() -> None:
    rows = support.grid_rows(SwappedPair(), GRID_FP32, CPU, seed=1)
    assert gate_verdicts(rows, "contract_violations") == {FAIL}
    rows = support.grid_rows(ScaledWeights(1 + 1e-4), GRID_FP32, CPU, seed=1)  # up to 2.5e-4 off
    assert gate_verdicts(rows, "weight_max_abs") == {FAIL} and gate_verdicts(rows, "ids_mismatch") == {PASS}
    # 4e-6 relative: inside the 2e-5 of docs/routing.md §2, but far noisier than the fp32 reference against fp64.
    rows = support.grid_rows(ScaledWeights(1 + 4e-6), GRID_FP32, CPU, seed=1)
    assert gate_verdicts(rows, "weight_max_abs") == {PASS} and gate_verdicts(rows, "rmse_vs_golden") == {FAIL}


def test_ties_toward_the_highest_id_fail_the_bf16_audit(monkeypatch) -> None:
    from parity.suites.routing import mutants as mutants_routing

    monkeypatch.setattr(serving_routing, "tie_break_order_key", serving_routing.tie_break_order_key)
    mutants_routing.serving_ties_to_highest_id()
    rows = support.grid_rows(ServingRouter(), GRID_BF16, CPU, seed=1)  # bf16 logits at E 256: exact ties
    [ids] = [row for row in rows if row.metric == "ids_mismatch"]
    assert ids.verdict == FAIL and "margin 0 " in ids.detail


def test_edge_rows_catch_clamped_non_finite_logits() -> None:
    case = next(case for case in cases.CASES["edge"] if case.name == "nan-fewer-than-k-finite-E8-k4")
    assert not [row for row in support.edge_rows(ServingRouter(), case, "fp32", CPU) if row.failed]
    rows = support.edge_rows(NanToZero(), case, "fp32", CPU)
    assert FAIL in {row.verdict for row in rows if row.metric == "ids_mismatch" and row.site == "rule"}


def test_batch_check_catches_a_batch_dependent_router() -> None:
    assert not [row for row in support.batch_rows(ServingRouter(), "softmax", False, CPU, seed=1) if row.failed]
    rows = support.batch_rows(BatchShifted(), "softmax", False, CPU, seed=1)
    assert FAIL in gate_verdicts(rows, "weight_max_abs")


def test_pad_check_compares_real_rows_with_an_unpadded_run() -> None:
    point = support.PadPoint("softmax", "T-1", "garbage")
    assert not [row for row in support.pad_rows(ServingRouter(), point, CPU, seed=1) if row.failed]
    rows = support.pad_rows(BatchShifted(), point, CPU, seed=1)  # real rows depend on the batch
    assert FAIL in {row.verdict for row in rows if row.site == "unpadded"}


def test_load_check_catches_a_counter_that_counts_pads_and_a_remap_without_guard() -> None:
    assert not [row for row in support.load_rows(ServingRouter(), 17, 2, 9, CPU, seed=1) if row.failed]
    rows = support.load_rows(LoadIgnoresCount(), 17, 2, 9, CPU, seed=1)
    # The router already writes -1 into pad rows, so only raw ids with valid-looking pad rows can
    # show a counter that ignores the count.
    verdicts = {row.site: row.verdict for row in rows if row.metric == "load_mismatch"}
    assert verdicts == {"routed_ids": PASS, "raw_ids": FAIL}
    rows = support.load_rows(RemapWithoutGuard(), 17, 2, 9, CPU, seed=1)
    assert gate_verdicts(rows, "minus_one_changed") == {FAIL} and gate_verdicts(rows, "remap_mismatch") == {FAIL}


class CopiesAllButTheCount:
    """A runner whose graphs copy new logits in before each replay but not the step's count."""

    def __init__(self) -> None:
        self.runner = make_runner("cpu_graph", device=CPU, capture_registry=serving_capture)

    def prepare(self, fn, examples, **kwargs):
        prepared = self.runner.prepare(fn, examples, **kwargs)
        static = prepared.static

        def copy_in(inputs):
            for index, (buffer, new) in enumerate(zip(static.buffers, inputs)):
                if index != 1:  # input 1 is the count
                    buffer.copy_(new)

        prepared._copy_in = copy_in
        return prepared


def test_replay_check_catches_a_count_that_is_not_written_each_step() -> None:
    runner = make_runner("cpu_graph", device=CPU, capture_registry=serving_capture)
    assert not [row for row in support.replay_rows(ServingRouter(), runner, "grouped", CPU, seed=1) if row.failed]
    rows = support.replay_rows(ServingRouter(), CopiesAllButTheCount(), "grouped", CPU, seed=1)
    stale = [row for row in rows if row.failed]
    assert stale and {row.verdict for row in stale} == {FAIL}, "a stale count must replay wrong routes"
    assert all(row.case.startswith("replay-grouped-C16-step") for row in stale)
    rows = support.replay_rows(ServingRouter(), make_runner("cpu_graph", device=CPU, copy_inputs=False), "softmax", CPU, seed=1)
    assert FAIL in gate_verdicts(rows, "ids_mismatch")


def test_host_read_count_is_an_error_row_not_an_exception(monkeypatch) -> None:
    from parity.suites.routing import mutants as mutants_routing

    monkeypatch.setattr(serving_routing, "valid_row_count", serving_routing.valid_row_count)
    mutants_routing.serving_count_on_host()
    rows = support.replay_rows(ServingRouter(), make_runner("cpu_graph", device=CPU), "softmax", CPU, seed=1)
    assert [(row.metric, row.verdict) for row in rows] == [("capture", ERROR)]
    assert "host read" in rows[0].detail


# ---- rank rows: the comparison logic on hand-made gathered results -------------------------------


def gathered_results(case: ranks.RankCase, kind: str, seed: int) -> dict[int, dict]:
    expected = ranks.expected_gather(case, kind, seed)
    fields = {field: expected[field].clone() for field in ranks.GATHERED_FIELDS}
    name = ranks.rank_case_name(case, kind)
    return {
        rank: {name: {path: {f: t.clone() for f, t in fields.items()} for path in ("route_then_gather", "gather_then_route")}}
        for rank in range(ranks.WORLD_SIZE)
    }


RANK_CASE = cases.CASES["rank_case"][0]


@pytest.mark.parametrize(
    "breakage,metric",
    [
        ("ids travel one row off their hidden rows", "ids_mismatch"),
        ("hidden rows reordered", "rows_misaligned"),
        ("pad rows routed after the gather", "ids_mismatch"),
        ("counts not gathered", "counts_mismatch"),
        ("rank 1 sees other tensors", "ranks_disagree"),
    ],
)
def test_rank_rows_catch_broken_gathers(breakage: str, metric: str) -> None:
    results = gathered_results(RANK_CASE, "softmax", seed=3)
    assert not [row for row in ranks.rank_rows(RANK_CASE, "softmax", results, 3, "test") if row.failed]
    name = ranks.rank_case_name(RANK_CASE, "softmax")
    got = results[0][name]["route_then_gather"]
    if breakage == "ids travel one row off their hidden rows":
        got["ids"] = torch.roll(got["ids"], 1, dims=0)
    elif breakage == "hidden rows reordered":
        got["hidden"] = torch.roll(got["hidden"], 1, dims=0)
    elif breakage == "pad rows routed after the gather":
        got["ids"][RANK_CASE.counts[0] :] = 0
    elif breakage == "counts not gathered":
        got["counts"] = torch.zeros_like(got["counts"])
    else:
        results[1][name]["route_then_gather"]["weights"] += 1.0
    rows = ranks.rank_rows(RANK_CASE, "softmax", results, 3, "test")
    assert FAIL in gate_verdicts(rows, metric), [row for row in rows if row.failed]


def test_rank_rows_turn_a_worker_error_into_an_error_row() -> None:
    name = ranks.rank_case_name(RANK_CASE, "grouped")
    rows = ranks.rank_rows(RANK_CASE, "grouped", {0: {name: {"error": "rank 0: RuntimeError: boom"}}, 1: {}}, 3, "test")
    assert [(row.metric, row.verdict) for row in rows] == [("rank_run", ERROR)] and "boom" in rows[0].detail


# ---- the case file --------------------------------------------------------------------------------


def test_counts_resolve_from_expressions_of_t() -> None:
    assert [cases.resolve_count(e, 16) for e in ["0", "1", "T-1", "T", "T+3", "-1", "T/2"]] == [0, 1, 15, 16, 19, -1, 8]
    with pytest.raises(ValueError, match="expected an integer or T"):
        cases.resolve_count("half", 16)


def test_grid_has_512_points_and_every_grouped_point_has_groups() -> None:
    points = support.grid_points()
    assert len(points) == 512 and len({point.name for point in points}) == 512
    for point in points:
        if cases.KINDS[point.kind].grouped:
            groups, keep = cases.group_params(point.experts, point.k)
            assert point.k <= keep * point.experts // groups


@pytest.mark.parametrize(
    "old,new,message",
    [
        (
            "k = [1, 2, 4]\nnum_expert_group = 4\ntopk_group = 2",
            "k = [1, 2, 4, 8]\nnum_expert_group = 4\ntopk_group = 2",
            "k=8 exceeds the 4 experts left",
        ),
        ('kinds = ["softmax", "grouped"]\nlogit_std', 'kinds = ["softmax", "topk"]\nlogit_std', "unknown kind 'topk'"),
        ('name = "E40"\nexperts = 40', 'name = "E40"\nexperts = 80', "no row for E=40"),
    ],
)
def test_a_malformed_case_file_names_the_table(old: str, new: str, message: str, tmp_path: Path, monkeypatch) -> None:
    text = (PROJECT_ROOT / "cases" / "routing.toml").read_text()
    assert old in text
    (tmp_path / "routing.toml").write_text(text.replace(old, new))
    monkeypatch.setenv("PARITY_CASES_DIR", str(tmp_path))
    with pytest.raises(cases.CaseFileError, match=message):
        cases._load_cases()

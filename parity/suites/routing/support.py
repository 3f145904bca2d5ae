"""The checks of the `routing` suite: inputs, comparisons, the near-tie audit, one function per family.

Every check takes the target's router adapter (`target.router()`: see
`serving_models/routing/adapter.py` for the contract) and returns `Check`s (verdicts placed at a case and site); the suite modules only
write them through the `report` fixture. Keeping the checks here, as plain functions of a router,
lets `tests/suites/test_suites_routing.py` hand them broken routers in-process and show each one goes red.

The truth is `reference_models.routing.router` (a plain per-row loop; `golden=True` gives fp64 weights
for the same experts, `routing_margins` the k-th vs (k+1)-th key margins for the near-tie audit).
Nothing here imports the serving package: the target arrives through the adapter. The rank-
family lives in `parity/suites/routing/ranks.py`, the case file in `parity/suites/routing/cases.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from parity.cases import CaseFileError, case_path
from parity.compare import AT_MOST, ERROR, FAIL, PASS, TIE_FLIP, Tolerance, Verdict, count_rule, diff, flag_rule, noise_floor_rule
from parity.runners.base import CaptureError
from parity.suites.routing.cases import (
    CASE_FILE,
    CASES,
    DTYPES,
    KINDS,
    TOL_EXACT,
    TOL_GOLDEN,
    TOL_WEIGHTS,
    BatchSpec,
    EdgeCase,
    GridSpec,
    Kind,
    LoadSpec,
    PadSpec,
    RefuseCase,
    ReplaySpec,
    count_label,
    group_params,
    resolve_count,
)
from parity.target import router_result_problem
from reference_models.routing import router as reference

# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded from several ints (case seed + --seed, then what varies)."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % (1 << 62)
    return torch.Generator().manual_seed(seed)


def make_bias(kind: Kind, experts: int, seed: int, device: torch.device) -> torch.Tensor | None:
    """The kind's fp32 correction bias: `-rand - 1` (all keys negative: the 0.0-mask trap)."""
    if kind.bias == "none":
        return None
    return (-torch.rand(experts, generator=generator(seed, experts, 17)) - 1.0).to(device)


def routing_options(kind: Kind, experts: int, k: int, renormalize: bool, bias: torch.Tensor | None) -> dict[str, Any]:
    """`select_experts` keyword arguments of a kind at (E, k)."""
    options: dict[str, Any] = dict(
        scoring=kind.scoring,
        renormalize=renormalize,
        routed_scaling_factor=kind.routed_scaling_factor,
        num_shared_experts=kind.num_shared_experts,
    )
    if kind.grouped:
        options["num_expert_group"], options["topk_group"] = group_params(experts, k)
    if bias is not None:
        options["correction_bias"] = bias
    return options


def margin_options(options: dict[str, Any]) -> dict[str, Any]:
    """The subset of routing options that `reference.routing_margins` takes."""
    keys = ("scoring", "num_expert_group", "topk_group", "correction_bias")
    return {key: options[key] for key in keys if key in options}


def count_tensor(count: int, device: torch.device) -> torch.Tensor:
    """The device-side valid-row count (int32, shape [1]) a serving engine keeps."""
    return torch.tensor([count], dtype=torch.int32, device=device)


def fill_pad_rows(logits: torch.Tensor, real: int, fill: str, gen: torch.Generator) -> torch.Tensor:
    """Pad rows (from `real` on) hold NaN, or garbage: size-1e4 values and ±inf that win if read."""
    pad = logits.shape[0] - real
    if pad <= 0:
        return logits
    if fill == "nan":
        logits[real:] = math.nan
    elif fill == "garbage":
        garbage = 1e4 * torch.randn(pad, logits.shape[1], generator=gen)
        garbage[:, ::5] = math.inf
        garbage[:, 1::7] = -math.inf
        logits[real:] = garbage.to(logits.dtype)
    else:
        raise ValueError(f"unknown pad fill {fill!r}")
    return logits


# ---------------------------------------------------------------------------------------------
# Rows and comparisons
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Check:
    """A `Verdict` one check decided and the row it goes to (`case`, `site`): the arguments of one
    `report.verdict` call (or, `info=True`, of one `report.info` call: a number recorded beside).

    Every gate is a `Verdict` from the rules of parity.compare, so the row's value, threshold,
    bound and direction (`better`) are the verdict's own, as in every other suite. The checks
    return these rather than write them so that tests/suites/test_suites_routing.py can hand them broken
    routers in-process; `write_rows` writes them through the `report` fixture."""

    case: str
    decided: Verdict
    site: str = ""
    info: bool = False

    metric = property(lambda self: self.decided.metric)
    value = property(lambda self: self.decided.value)
    verdict = property(lambda self: self.decided.verdict)
    threshold = property(lambda self: self.decided.threshold)
    detail = property(lambda self: self.decided.detail)

    @property
    def kind(self) -> str:
        return "info" if self.info else "gate"

    @property
    def failed(self) -> bool:
        return not self.info and self.verdict in (FAIL, ERROR)

    def write(self, report: Any, **where: Any) -> None:
        """One row through the shared row API (`report.verdict` / `report.info`)."""
        decided = self.decided
        if self.info:  # no rule decided it; the routing suite's info rows carry no direction
            report.info(
                case=self.case,
                site=self.site,
                metric=decided.metric,
                value=decided.value,
                verdict=decided.verdict,
                detail=decided.detail,
                threshold=decided.threshold,
                **where,
            )
        else:
            report.verdict(decided, case=self.case, site=self.site, **where)


def write_rows(report: Any, checks: Sequence[Check], *, mode: str = "eager", seed: int | None = None) -> None:
    for check in checks:
        check.write(report, mode=mode, seed=seed)


def unpack(result: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of a router result, by field name when it has them."""
    if hasattr(result, "weights") and hasattr(result, "ids"):
        return result.weights, result.ids
    return result[0], result[1]


def contract_violations(result: Any, rows: int, k: int, num_shared: int, num_experts: int) -> list[str]:
    """The contract (docs/routing.md §1 and §5; R4, R5, R7): the pair (weights, ids), plain or
    named (`parity.target.router_result_problem`, the rule `parity check-target` applies too,
    docs/targets.md §7), int32 ids, fp32 weights, shape [T, k+S]; weights finite and >= 0, 0 on -1
    slots; routed ids -1 or in [0, E) and distinct per row; shared column i holds -1 or E + i."""
    problems = []
    width = k + num_shared
    form = router_result_problem(result)
    if form is not None:
        problems.append(f"result is {form}")
    try:
        weights, ids = unpack(result)
    except (TypeError, IndexError, KeyError):
        return problems  # nothing to read weights and ids from: the line above says what came back
    if not isinstance(weights, torch.Tensor) or not isinstance(ids, torch.Tensor):
        return [*problems, f"weights and ids must be tensors, got {type(weights).__name__} / {type(ids).__name__}"]
    if ids.dtype != torch.int32 or weights.dtype != torch.float32:
        problems.append(f"dtypes ids {ids.dtype} / weights {weights.dtype}, expected int32 / float32")
    if tuple(ids.shape) != (rows, width) or tuple(weights.shape) != (rows, width):
        problems.append(f"shapes ids {tuple(ids.shape)} / weights {tuple(weights.shape)}, expected {(rows, width)}")
        return problems
    if not weights.is_floating_point() or ids.is_floating_point():
        return problems
    w, i = weights.detach().cpu(), ids.detach().cpu().to(torch.int64)

    def count(bad: torch.Tensor, what: str) -> None:
        if bad.any():
            problems.append(f"{int(bad.sum())} {what} (first row {int(bad.reshape(rows, -1).any(1).nonzero()[0, 0])})")

    count(~torch.isfinite(w) | (w < 0), "weights non-finite or negative")
    count((i < 0) & (w != 0), "-1 slots carry weight")
    routed = i[:, :k]
    count((routed < -1) | (routed >= num_experts), "routed ids outside -1 / [0, E)")
    shared_ids = num_experts + torch.arange(num_shared, dtype=torch.int64)
    count((i[:, k:] != -1) & (i[:, k:] != shared_ids), "shared slots neither -1 nor E + i")
    ordered = torch.sort(routed, dim=1).values
    count(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1), "rows repeat a routed id")
    return problems


def contract_row(case: str, result: Any, rows: int, k: int, num_shared: int, num_experts: int) -> Check:
    problems = contract_violations(result, rows, k, num_shared, num_experts)
    return Check(case, count_rule(len(problems), 0, metric="contract_violations", at=AT_MOST, detail="; ".join(problems) or "ok"))


def differing_rows(ref_ids: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
    """Indices of rows whose id vectors differ (any column)."""
    if ref_ids.shape != cand_ids.shape:
        raise ValueError(f"ids shape mismatch: reference {tuple(ref_ids.shape)} vs target {tuple(cand_ids.shape)}")
    return (ref_ids.detach().cpu().to(torch.int64) != cand_ids.detach().cpu().to(torch.int64)).any(dim=1).nonzero().flatten()


def rows_text(rows: torch.Tensor, limit: int = 8) -> str:
    shown = ", ".join(str(int(r)) for r in rows[:limit])
    return shown + (f", ... ({rows.numel()} rows)" if rows.numel() > limit else "")


def ids_row(case: str, ref_ids: torch.Tensor, cand_ids: torch.Tensor, *, site: str = "", what: str = "reference") -> Check:
    """Gate: ids must be equal; value = number of differing rows."""
    rows = differing_rows(ref_ids, cand_ids)
    if rows.numel() == 0:
        detail = f"ids equal to the {what} ({ref_ids.shape[0]} rows)"
    else:
        first = int(rows[0])
        detail = (
            f"{rows.numel()}/{ref_ids.shape[0]} rows differ from the {what}: rows {rows_text(rows)}; "
            f"row {first}: {what} {ref_ids[first].tolist()} vs target {cand_ids[first].tolist()}"
        )
    return Check(case, count_rule(int(rows.numel()), 0, metric="ids_mismatch", at=AT_MOST, detail=detail), site)


def weights_row(case: str, ref_w: torch.Tensor, cand_w: torch.Tensor, tol: Tolerance, *, site: str = "", note: str = "") -> Check:
    """Gate: weights within `tol` of the reference (rows compared as given)."""
    measured = diff(ref_w, cand_w, tol, name="weights")
    verdict = measured.verdict("max_abs")
    detail = f"{verdict.detail}; {tol.describe()}" + (f"; {note}" if note else "")
    return Check(case, dataclasses.replace(verdict, metric="weight_max_abs", detail=detail), site)


# ---------------------------------------------------------------------------------------------
# Near-tie audit (docs/tolerances.md §3)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Decision:
    """One differing row of the target, classified: a decision inside the dtype's noise is a
    `tie_flip`; anything else (an exact tie has the rule docs/routing.md R3, a wide margin has no excuse) a `fail`."""

    row: int
    where: str  # "k-boundary" (the expert set differs), "slot j" (order inside the set), "shared"
    margin: float
    margin_ulps: float  # in spacings of the input dtype at the keys' magnitude
    group_margin_ulps: float
    verdict: str

    def describe(self, dtype_name: str) -> str:
        group = "" if math.isinf(self.group_margin_ulps) else f", group margin {self.group_margin_ulps:.3g} ulp"
        return f"row {self.row} {self.where}: margin {self.margin:.3g} = {self.margin_ulps:.3g} {dtype_name} ulp{group} -> {self.verdict}"


def _within(ulps: float, spacings: float) -> bool:
    return 0.0 < ulps <= spacings


def audit_decisions(
    logits: torch.Tensor,
    ref_ids: torch.Tensor,
    cand_ids: torch.Tensor,
    k: int,
    options: dict[str, Any],
    *,
    spacings: float,
    exact: bool,
) -> list[Decision]:
    """Classify every row whose ids differ from the reference's.

    The expert set differs: the k-th vs (k+1)-th key margin (and for grouped routing the kept
    vs first dropped group margin) decides; the set is equal but the order differs at slot j: the
    j-th vs (j+1)-th margin. Margins come from `reference.routing_margins` in spacings of the
    logits' dtype. `exact=True` (fp32 logits: ids must equal) turns every difference into `fail`,
    margin still recorded. A margin of exactly 0 is a tie that R3 decides (lower id), so a flip
    there is a `fail` too.
    """
    decisions = []
    eps_ratio = torch.finfo(torch.float32).eps / torch.finfo(logits.dtype).eps
    margins_of = margin_options(options)
    ref_cpu, cand_cpu = ref_ids.detach().cpu(), cand_ids.detach().cpu()
    for row in differing_rows(ref_ids, cand_ids).tolist():
        ref_routed, cand_routed = ref_cpu[row, :k].tolist(), cand_cpu[row, :k].tolist()
        if set(ref_routed) != set(cand_routed):
            where, boundary = "k-boundary", k
        elif ref_routed != cand_routed:
            slot = next(j for j, (a, b) in enumerate(zip(ref_routed, cand_routed)) if a != b)
            where, boundary = f"slot {slot}", slot + 1
        else:
            decisions.append(Decision(row, "shared", math.nan, math.nan, math.inf, FAIL))
            continue
        m = reference.routing_margins(logits[row : row + 1], boundary, **margins_of)
        margin, ulps = float(m.margin[0]), float(m.margin_ulps_input[0])
        group_ulps = float(m.group_margin_ulps_fp32[0]) * eps_ratio if where == "k-boundary" else math.inf
        inside_noise = _within(ulps, spacings) or _within(group_ulps, spacings)
        verdict = TIE_FLIP if inside_noise and not exact else FAIL
        decisions.append(Decision(row, where, margin, ulps, group_ulps, verdict))
    return decisions


def audited_ids_row(case: str, decisions: list[Decision], rows: int, dtype_name: str, spacings: float, exact: bool) -> Check:
    """Gate `ids_mismatch`: pass (no differing row), tie_flip (all inside noise) or fail."""
    rule = (
        "fp32 logits: ids must equal the reference's"
        if exact
        else f"a differing decision is a tie_flip when 0 < margin <= {spacings:g} {dtype_name} spacings (docs/tolerances.md §3)"
    )
    if not decisions:
        return Check(case, Verdict(PASS, "ids_mismatch", 0, 0, f"ids equal to the reference ({rows} rows); {rule}"))
    verdict = FAIL if any(d.verdict == FAIL for d in decisions) else TIE_FLIP
    shown = "; ".join(d.describe(dtype_name) for d in decisions[:8])
    more = f"; ... {len(decisions)} rows" if len(decisions) > 8 else ""
    text = f"{len(decisions)}/{rows} rows differ: {shown}{more}; {rule}"
    return Check(case, Verdict(verdict, "ids_mismatch", len(decisions), 0, text))


# ---------------------------------------------------------------------------------------------
# grid- : the random sweep
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GridPoint:
    kind: str
    experts: int
    k: int
    rows: int
    dtype: str
    renormalize: bool
    table: str = "grid"  # "grid_serving_scale": the full-size lane's points

    @property
    def name(self) -> str:
        renorm = "renorm" if self.renormalize else "norenorm"
        scale = "-serving-scale" if self.table == "grid_serving_scale" else ""
        return f"grid{scale}-{self.kind}-E{self.experts}-k{self.k}-T{self.rows}-{self.dtype}-{renorm}"


def grid_points(table: str = "grid") -> list[GridPoint]:
    grid: GridSpec = CASES[table]
    return [
        GridPoint(kind, experts, k, rows, dtype, renormalize, table)
        for kind in grid.kinds
        for experts in grid.experts
        for k in grid.k
        for dtype in grid.dtypes
        for renormalize in grid.renormalize
        for rows in grid.rows  # innermost: consecutive points share one cached reference
    ]


@dataclasses.dataclass(frozen=True)
class GridTruth:
    """The reference's answer for every row of one grid logits tensor (sliced per T)."""

    logits: torch.Tensor  # [max T, E] in the point's dtype, on the device
    options: dict[str, Any]
    reference: reference.RoutingResult  # fp32 weights
    golden: reference.RoutingResult  # fp64 weights, same experts


@functools.lru_cache(maxsize=4)
def grid_truth(
    kind_name: str, experts: int, k: int, dtype: str, renormalize: bool, device: str, seed: int, table: str = "grid"
) -> GridTruth:
    """Reference and golden routes of the largest T once; smaller T take the first rows (the
    reference routes row by row, so a row's answer does not depend on the rows around it)."""
    grid: GridSpec = CASES[table]
    kind = KINDS[kind_name]
    torch_device = torch.device(device)
    logits32 = grid.logit_std * torch.randn(max(grid.rows), experts, generator=generator(seed, experts))
    logits = logits32.to(DTYPES[dtype]).to(torch_device)
    options = routing_options(kind, experts, k, renormalize, make_bias(kind, experts, seed, torch_device))
    return GridTruth(
        logits,
        options,
        reference.select_experts(logits, k, **options),
        reference.select_experts(logits, k, golden=True, **options),
    )


def grid_rows(router: Any, point: GridPoint, device: torch.device, seed: int) -> list[Check]:
    """ids (exact on fp32, audited on bf16), weights vs the reference and vs the fp64 golden, contract."""
    grid: GridSpec = CASES[point.table]
    truth = grid_truth(point.kind, point.experts, point.k, point.dtype, point.renormalize, str(device), seed, point.table)
    logits = truth.logits[: point.rows].clone()
    ref_w, ref_ids = truth.reference.weights[: point.rows], truth.reference.ids[: point.rows]
    golden_w = truth.golden.weights[: point.rows]
    result = router.select_experts(logits, point.k, **truth.options)
    rows = [contract_row(point.name, result, point.rows, point.k, KINDS[point.kind].num_shared_experts, point.experts)]
    cand_w, cand_ids = unpack(result)
    if tuple(cand_ids.shape) != tuple(ref_ids.shape) or tuple(cand_w.shape) != tuple(ref_w.shape):
        return rows  # the contract row says which shape is wrong; nothing else is comparable
    if not cand_w.is_floating_point() or cand_ids.is_floating_point():
        return rows  # weights and ids in each other's places (the contract row says so): not comparable
    exact = point.dtype == "fp32"
    decisions = audit_decisions(logits, ref_ids, cand_ids, point.k, truth.options, spacings=grid.tie_flip_spacings, exact=exact)
    rows.append(audited_ids_row(point.name, decisions, point.rows, point.dtype, grid.tie_flip_spacings, exact))
    # Weights are compared where the ids agree (a flipped decision moves its weights too).
    same = torch.ones(point.rows, dtype=torch.bool)
    same[[d.row for d in decisions]] = False
    same = same.to(cand_w.device)
    note = f"{point.rows - int(same.sum())} rows with differing ids left out" if decisions else ""
    rows.append(weights_row(point.name, ref_w[same], cand_w[same], TOL_WEIGHTS, note=note))
    verdict, floor = noise_floor_rule(golden_w[same], ref_w[same], cand_w[same], TOL_GOLDEN, name="weights")
    rows.append(Check(point.name, dataclasses.replace(verdict, detail=f"{verdict.detail}; {TOL_GOLDEN.describe()}")))
    flips = [d for d in decisions if d.verdict == TIE_FLIP]
    if flips:
        widest = max(d.margin_ulps for d in flips)
        rows.append(
            Check(
                point.name,
                Verdict(TIE_FLIP, "tie_flip_max_margin_ulps", widest, grid.tie_flip_spacings, f"{len(flips)} tie flips"),
                info=True,
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------
# tie- and nan- : hand-built rows
# ---------------------------------------------------------------------------------------------


def edge_logits(case: EdgeCase) -> torch.Tensor:
    if case.logits is not None:
        return torch.tensor(case.logits, dtype=torch.float32)
    if case.pattern == "zeros":
        return torch.zeros(case.rows, case.experts)
    plateau = (torch.arange(case.experts) % 7 - 3).to(torch.float32)  # pattern "plateau"
    return plateau.expand(case.rows, case.experts).clone()


def edge_options(case: EdgeCase, device: torch.device) -> dict[str, Any]:
    options: dict[str, Any] = dict(
        scoring=case.scoring,
        renormalize=case.renormalize,
        routed_scaling_factor=case.routed_scaling_factor,
        num_shared_experts=case.num_shared_experts,
    )
    if case.num_expert_group is not None:
        options.update(num_expert_group=case.num_expert_group, topk_group=case.topk_group)
    if case.bias is not None:
        options["correction_bias"] = torch.tensor(case.bias, dtype=torch.float32, device=device)
    return options


def edge_rows(router: Any, case: EdgeCase, dtype: str, device: torch.device) -> list[Check]:
    """The rule (hand-written ids), the reference (ids exact, weights within docs/routing.md §2), the contract."""
    name = f"{case.name}-{dtype}"
    logits = edge_logits(case).to(DTYPES[dtype]).to(device)
    options = edge_options(case, device)
    expected = torch.tensor(case.expected_ids, dtype=torch.int64)
    width = case.k + case.num_shared_experts
    if tuple(expected.shape) != (logits.shape[0], width):
        raise CaseFileError(
            f"{case_path(CASE_FILE)}: table [edge] case {case.name!r}: expected_ids shape {tuple(expected.shape)}, rows x (k + S) is {(logits.shape[0], width)}"
        )
    result = router.select_experts(logits, case.k, **options)
    truth = reference.select_experts(logits, case.k, **options)
    rows = [contract_row(name, result, logits.shape[0], case.k, case.num_shared_experts, logits.shape[1])]
    cand_w, cand_ids = unpack(result)
    if tuple(cand_ids.shape) != tuple(expected.shape):
        return rows
    rows.append(ids_row(name, expected, cand_ids, site="rule", what="rule (hand-written ids)"))
    rows.append(ids_row(name, truth.ids, cand_ids, site="reference"))
    rows.append(weights_row(name, truth.weights, cand_w, TOL_WEIGHTS, site="reference"))
    return rows


def edge_cases() -> list[tuple[EdgeCase, str]]:
    return [(case, dtype) for case in CASES["edge"] for dtype in case.dtypes]


# ---------------------------------------------------------------------------------------------
# refuse- : a configuration a router must not route as asked
# ---------------------------------------------------------------------------------------------


def refuse_rows(router: Any, case: RefuseCase, device: torch.device, seed: int) -> list[Check]:
    """Groups of one expert with a correction bias (docs/routing.md §3): the target refuses it
    (raises, the reference's rule) or routes it as ungrouped routing (vLLM's fallback); experts
    chosen by group id fail. The reference must refuse it too."""
    gen = generator(seed, case.experts, case.k)
    logits = (2.0 * torch.randn(case.rows, case.experts, generator=gen)).to(device)
    bias = (-torch.rand(case.experts, generator=gen) - 1.0).to(device)
    grouped = dict(num_expert_group=case.num_expert_group, topk_group=case.topk_group)
    options: dict[str, Any] = dict(scoring="sigmoid", renormalize=True, correction_bias=bias)
    rows: list[Check] = []
    try:
        reference.select_experts(logits, case.k, **options, **grouped)
        refused_by_reference = ""
    except ValueError as exc:
        refused_by_reference = str(exc)
    rows.append(
        Check(
            case.name,
            flag_rule(
                bool(refused_by_reference), metric="reference_refuses", detail=refused_by_reference or "the reference routed it"
            ),
            "reference",
        )
    )
    ungrouped = reference.select_experts(logits, case.k, **options)
    try:
        result = router.select_experts(logits, case.k, **options, **grouped)
    except Exception as exc:  # a refusal: any exception a caller sees before a route is made
        detail = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
        rows.append(Check(case.name, flag_rule(True, metric="refused_or_ungrouped", detail=detail), "target"))
        return rows
    try:
        _, ids = unpack(result)
        routed = ids.detach().cpu().to(torch.int64)[:, : case.k]
    except (TypeError, IndexError, KeyError, AttributeError) as exc:
        detail = f"routed, and the result has no readable ids ({type(exc).__name__})"
        rows.append(Check(case.name, flag_rule(False, metric="refused_or_ungrouped", detail=detail), "target"))
        return rows
    expected = ungrouped.ids.cpu().to(torch.int64)[:, : case.k]
    same = tuple(routed.shape) == tuple(expected.shape) and bool(torch.equal(routed, expected))
    detail = (
        "routed as ungrouped routing (vLLM's fallback)"
        if same
        else f"routed row 0 to {routed[0].tolist()}, ungrouped routing picks {expected[0].tolist()} (experts chosen by group id?)"
    )
    rows.append(Check(case.name, flag_rule(same, metric="refused_or_ungrouped", detail=detail), "target"))
    return rows


# ---------------------------------------------------------------------------------------------
# pad- : the device-side valid-row count
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PadPoint:
    kind: str
    count: str
    fill: str

    def name(self, rows: int) -> str:
        return f"pad-{self.kind}-T{rows}-{count_label(resolve_count(self.count, rows))}-{self.fill}"


def pad_points() -> list[PadPoint]:
    spec: PadSpec = CASES["pad"]
    return [PadPoint(kind, count, fill) for kind in spec.kinds for count in spec.counts for fill in spec.fills]


def pad_inputs(point: PadPoint, device: torch.device, seed: int) -> tuple[torch.Tensor, int, dict[str, Any]]:
    """(logits, count, options) of a pad- case: real rows, then garbage or NaN pad rows."""
    spec: PadSpec = CASES["pad"]
    kind, rows_ = KINDS[point.kind], spec.rows
    count = resolve_count(point.count, rows_)
    gen = generator(seed, rows_, count, spec.fills.index(point.fill))
    logits = fill_pad_rows(2.0 * torch.randn(rows_, spec.experts, generator=gen), min(max(count, 0), rows_), point.fill, gen)
    options = routing_options(kind, spec.experts, spec.k, spec.renormalize, make_bias(kind, spec.experts, seed, device))
    return logits.to(device), count, options


def pad_rows(router: Any, point: PadPoint, device: torch.device, seed: int) -> list[Check]:
    """Pad rows -1 / 0 in every column; real rows equal an unpadded run bit for bit and the reference."""
    spec: PadSpec = CASES["pad"]
    kind, rows_, name = KINDS[point.kind], spec.rows, point.name(spec.rows)
    logits, count, options = pad_inputs(point, device, seed)
    real = min(max(count, 0), rows_)
    width = spec.k + kind.num_shared_experts

    result = router.select_experts(logits, spec.k, num_valid_rows=count_tensor(count, device), **options)
    rows = [contract_row(name, result, rows_, spec.k, kind.num_shared_experts, spec.experts)]
    weights, ids = unpack(result)
    if tuple(ids.shape) != (rows_, width):
        return rows
    pad_ids, pad_w = ids[real:].detach().cpu(), weights[real:].detach().cpu()
    routed_pads = ((pad_ids != -1).any(dim=1) | (pad_w != 0).any(dim=1)).nonzero().flatten() + real
    detail = f"{rows_ - real} pad rows (count {count}, {point.fill} logits)"
    if routed_pads.numel():
        first = int(routed_pads[0])
        detail += (
            f"; routed: rows {rows_text(routed_pads)}; row {first}: ids {ids[first].tolist()} weights {weights[first].tolist()}"
        )
    rows.append(Check(name, count_rule(int(routed_pads.numel()), 0, metric="pad_routes", at=AT_MOST, detail=detail), "pad_rows"))

    unpadded = router.select_experts(logits[:real].clone(), spec.k, **options)
    un_w, un_ids = unpack(unpadded)
    rows.append(ids_row(name, un_ids, ids[:real], site="unpadded", what="unpadded run"))
    rows.append(weights_row(name, un_w, weights[:real], TOL_EXACT, site="unpadded"))
    truth = reference.select_experts(logits, spec.k, num_valid_rows=count, **options)
    rows.append(ids_row(name, truth.ids, ids, site="reference"))
    rows.append(weights_row(name, truth.weights, weights, TOL_WEIGHTS, site="reference"))
    return rows


# ---------------------------------------------------------------------------------------------
# replay- : one capture, replayed while the runner writes each step's count
# ---------------------------------------------------------------------------------------------


def replay_rows(router: Any, runner: Any, kind_name: str, device: torch.device, seed: int) -> list[Check]:
    """Record once at capacity C (the runner's dummy inputs), replay with each step's logits and
    count copied into the static buffers; every replay must equal eager on the same inputs."""
    spec: ReplaySpec = CASES["replay"]
    kind, capacity = KINDS[kind_name], spec.capacity
    prefix = f"replay-{kind_name}-C{capacity}"
    bias = make_bias(kind, spec.experts, seed, device)
    options = routing_options(kind, spec.experts, spec.k, spec.renormalize, None)

    def route(logits: torch.Tensor, count: torch.Tensor, *maybe_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        extra = {"correction_bias": maybe_bias[0]} if maybe_bias else {}
        return tuple(unpack(router.select_experts(logits, spec.k, num_valid_rows=count, **options, **extra)))

    examples = (torch.zeros(capacity, spec.experts, device=device), count_tensor(capacity, device))
    examples += (bias,) if bias is not None else ()
    try:
        prepared = runner.prepare(route, examples, name=f"{router.name} router select_experts")
    except CaptureError as error:
        text = f"{type(error).__name__}: {error}".replace("\n", " | ")
        return [Check(f"{prefix}-capture", Verdict(ERROR, "capture", None, None, text))]
    rows = [
        Check(
            f"{prefix}-capture",
            Verdict(
                PASS,
                "probe_during_capture",
                float(bool(getattr(prepared, "probe_during_capture", None))),
                None,
                "whether the target's capture probe answered True while recording",
            ),
            info=True,
        )
    ]
    gen = generator(seed, capacity, spec.experts)
    for step, expr in enumerate(spec.counts):
        count = resolve_count(expr, capacity)
        name = f"{prefix}-step{step}-{count_label(count)}"
        logits = fill_pad_rows(
            2.0 * torch.randn(capacity, spec.experts, generator=gen), min(max(count, 0), capacity), "nan", gen
        ).to(device)
        inputs = (logits, count_tensor(count, device)) + ((bias,) if bias is not None else ())
        replayed_w, replayed_ids = prepared(*inputs).output
        eager_w, eager_ids = route(*inputs)
        rows.append(ids_row(name, eager_ids, replayed_ids, what="eager run on the same inputs"))
        rows.append(weights_row(name, eager_w, replayed_w, TOL_EXACT))
    prepared.close()
    return rows


# ---------------------------------------------------------------------------------------------
# batch- : a row alone, in a batch, anywhere in it
# ---------------------------------------------------------------------------------------------


def batch_rows(router: Any, kind_name: str, renormalize: bool, device: torch.device, seed: int) -> list[Check]:
    spec: BatchSpec = CASES["batch"]
    kind = KINDS[kind_name]
    options = routing_options(kind, spec.experts, spec.k, renormalize, make_bias(kind, spec.experts, seed, device))
    pool = 2.0 * torch.randn(spec.probe_rows + max(spec.mates), spec.experts, generator=generator(seed, spec.experts))
    pool[: spec.probe_rows : 2] = pool[: spec.probe_rows : 2].round()  # integer rows: exact ties
    pool = pool.to(device)
    probe, mates_pool = pool[: spec.probe_rows], pool[spec.probe_rows :]
    alone = [unpack(router.select_experts(probe[i : i + 1].clone(), spec.k, **options)) for i in range(spec.probe_rows)]
    alone_w, alone_ids = torch.cat([w for w, _ in alone]), torch.cat([i for _, i in alone])
    renorm = "renorm" if renormalize else "norenorm"
    rows = []
    for mates in spec.mates:
        others = mates_pool[:mates]
        for position in spec.positions:
            start = {"front": 0, "middle": mates // 2, "back": mates}[position]
            batch = torch.cat([others[:start], probe, others[start:]])
            for counted in (False, True):
                name = f"batch-{kind_name}-{renorm}-mates{mates}-{position}-{'count' if counted else 'nocount'}"
                count = count_tensor(start + spec.probe_rows, device) if counted else None
                weights, ids = unpack(router.select_experts(batch, spec.k, num_valid_rows=count, **options))
                window = slice(start, start + spec.probe_rows)
                rows.append(ids_row(name, alone_ids, ids[window], what="rows routed alone"))
                rows.append(weights_row(name, alone_w, weights[window], TOL_EXACT))
    return rows


# ---------------------------------------------------------------------------------------------
# load- : the expert-load counter and the EPLB remap
# ---------------------------------------------------------------------------------------------


RAW_ID_WIDTH = 8  # columns of the raw id tensor: enough -1 and sentinel slots on every T


def replica_table(num_logical: int, replicas: int, device: torch.device) -> torch.Tensor:
    """Expert e lives at physical e; with 2 replicas even experts also live at E + e (uneven counts)."""
    table = torch.full((num_logical, replicas), -1, dtype=torch.int32)
    table[:, 0] = torch.arange(num_logical)
    if replicas == 2:
        table[::2, 1] = num_logical + torch.arange(0, num_logical, 2)
    return table.to(device)


def ids_with_holes(rows: int, num_logical: int, width: int, sentinel: int, gen: torch.Generator) -> torch.Tensor:
    """Raw ids: ~10% -1 (at least every fourth row's first slot), ~5% `sentinel` (outside every id
    space; at least every fourth row's last slot), valid-looking ids everywhere else, pad rows included."""
    ids = torch.randint(0, num_logical, (rows, width), generator=gen, dtype=torch.int32)
    holes = torch.rand(rows, width, generator=gen)
    ids[holes < 0.1] = -1
    ids[holes > 0.95] = sentinel
    ids[::4, 0] = -1
    ids[1::4, -1] = sentinel
    return ids


def load_points() -> list[tuple[int, int, int]]:
    """(rows, replicas, count) for every listed count, each resolved count once per T (at T = 1,
    "1" and "T" are the same case)."""
    spec: LoadSpec = CASES["load"]
    points = []
    for rows in spec.rows:
        counts = list(dict.fromkeys(resolve_count(expr, rows) for expr in spec.counts))
        points += [(rows, replicas, count) for replicas in spec.replicas for count in counts]
    return points


def load_name(rows: int, replicas: int, count: int) -> str:
    return f"load-T{rows}-replicas{replicas}-{count_label(count)}"


def load_rows(router: Any, rows_: int, replicas: int, count: int, device: torch.device, seed: int) -> list[Check]:
    """Load counts routes of real rows only (the router's routed columns, and raw ids with
    valid-looking pad rows); remap maps logical to physical ids and passes -1 and ids >= E through."""
    spec: LoadSpec = CASES["load"]
    kind = KINDS[spec.kind]
    real = min(max(count, 0), rows_)
    name = load_name(rows_, replicas, count)
    gen = generator(seed, rows_, replicas, count)
    logits = fill_pad_rows(2.0 * torch.randn(rows_, spec.experts, generator=gen), real, "garbage", gen).to(device)
    options = routing_options(kind, spec.experts, spec.k, True, make_bias(kind, spec.experts, seed, device))
    routed = unpack(router.select_experts(logits, spec.k, num_valid_rows=count_tensor(count, device), **options))[1]
    # docs/routing.md §5: remap the routed columns; the shared ones are appended after
    routed_ids = routed[:, : spec.k].contiguous()
    num_physical = spec.experts * replicas
    raw_ids = ids_with_holes(rows_, spec.experts, RAW_ID_WIDTH, num_physical + 1, gen).to(device)
    table = replica_table(spec.experts, replicas, device)
    choice = (torch.arange(rows_, dtype=torch.int32) * 7 + 3).to(device)
    rows = []
    for site, ids in (("routed_ids", routed_ids), ("raw_ids", raw_ids)):
        load = router.expert_load(ids, count_tensor(count, device), num_physical)
        want = reference.expert_load(ids, count, num_physical)
        wrong = (
            (load.detach().cpu().to(torch.int64) != want.cpu()).nonzero().flatten()
            if load.shape == want.shape
            else torch.arange(num_physical)
        )
        detail = f"routes per physical expert on {real} real rows of {rows_}: target {load.tolist()} vs reference {want.tolist()}"
        rows.append(Check(name, count_rule(int(wrong.numel()), 0, metric="load_mismatch", at=AT_MOST, detail=detail), site))

        physical = router.remap(ids, table, choice)
        expected = reference.remap(ids, table, choice)
        bad = physical.detach().cpu().to(torch.int64) != expected.cpu().to(torch.int64)
        first = (
            ""
            if not bad.any()
            else f"; first at {tuple(int(i) for i in bad.nonzero()[0])}: {int(ids.cpu()[tuple(bad.nonzero()[0])])} -> {int(physical.cpu()[tuple(bad.nonzero()[0])])}, expected {int(expected.cpu()[tuple(bad.nonzero()[0])])}"
        )
        rows.append(
            Check(
                name,
                count_rule(
                    int(bad.sum()),
                    0,
                    metric="remap_mismatch",
                    at=AT_MOST,
                    detail=f"{ids.numel()} ids, {replicas} replicas{first}",
                ),
                site,
            )
        )
        holes = ids.detach().cpu() == -1
        changed = int((physical.detach().cpu()[holes] != -1).sum())
        rows.append(
            Check(
                name,
                count_rule(
                    changed,
                    0,
                    metric="minus_one_changed",
                    at=AT_MOST,
                    detail=f"{int(holes.sum())} -1 ids must pass through unchanged",
                ),
                site,
            )
        )
    return rows

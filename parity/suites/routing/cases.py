"""The `routing` suite's case file (`cases/routing.toml`) as typed records.

Loaded once at import (a malformed file is then one readable collection error naming file,
table and key), with the cross-table checks the per-table types cannot express: kinds that must
exist, and a grouped-routing row for every (E, k) a grouped case routes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal

import torch

from parity.cases import (
    AnyFloat,
    CaseFileError,
    Count,
    NonNegative,
    Positive,
    Range,
    Seed,
    Table,
    Unavailable,
    case_path,
    deferring,
    load_case_file,
    unavailable,
)
from parity.compare import Tolerance

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CASE_FILE = "routing.toml"
Timeout = Annotated[float, Range(1e-3, 3600.0)]  # seconds a rank process may take: positive, under an hour


@dataclasses.dataclass(frozen=True)
class Kind:
    """A routing configuration family: softmax (docs/routing.md §2) or grouped sigmoid with a
    correction bias (docs/routing.md §3)."""

    name: str
    scoring: Literal["softmax", "sigmoid"]
    grouped: bool
    bias: Literal["none", "negative"]
    routed_scaling_factor: float
    num_shared_experts: Count


@dataclasses.dataclass(frozen=True)
class Groups:
    """Grouped-routing parameters for one expert count and the k values they serve."""

    name: str
    experts: Positive
    k: list[Positive]
    num_expert_group: Positive
    topk_group: Positive
    note: str


@dataclasses.dataclass(frozen=True)
class GridSpec:
    experts: list[Positive]
    k: list[Positive]
    rows: list[Count]
    dtypes: list[Literal["fp32", "bf16", "fp16"]]
    renormalize: list[bool]
    kinds: list[str]
    logit_std: NonNegative
    seed: Seed
    tie_flip_spacings: NonNegative


@dataclasses.dataclass(frozen=True)
class EdgeCase:
    """A hand-built tie- or nan- case: explicit rows (or a pattern) and hand-written expected ids."""

    name: str
    k: Positive
    expected_ids: list[list[int]]
    logits: list[list[AnyFloat]] | None = None
    pattern: Literal["zeros", "plateau"] | None = None
    experts: Positive | None = None
    rows: Count | None = None
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True
    num_expert_group: int | None = None
    topk_group: int | None = None
    bias: list[float] | None = None
    routed_scaling_factor: float = 1.0
    num_shared_experts: Count = 0
    dtypes: list[Literal["fp32", "bf16", "fp16"]] = dataclasses.field(default_factory=lambda: ["fp32", "bf16"])

    def __post_init__(self) -> None:
        if (self.logits is None) == (self.pattern is None):
            raise ValueError("give exactly one of logits and pattern")
        if self.pattern is not None and (self.experts is None or self.rows is None):
            raise ValueError("a pattern needs experts and rows")


@dataclasses.dataclass(frozen=True)
class PadSpec:
    rows: Positive
    experts: Positive
    k: Positive
    counts: list[str]
    fills: list[Literal["garbage", "nan"]]
    kinds: list[str]
    renormalize: bool
    seed: Seed


@dataclasses.dataclass(frozen=True)
class ReplaySpec:
    capacity: Positive
    experts: Positive
    k: Positive
    counts: list[str]
    kinds: list[str]
    renormalize: bool
    seed: Seed


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    experts: Positive
    k: Positive
    probe_rows: Positive
    mates: list[Count]
    positions: list[Literal["front", "middle", "back"]]
    kinds: list[str]
    renormalize: list[bool]
    seed: Seed


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    kind: str
    experts: Positive
    k: Positive
    rows: list[Count]
    replicas: list[Literal[1, 2]]
    counts: list[str]
    seed: Seed


@dataclasses.dataclass(frozen=True)
class RankSpec:
    capacity: Positive
    experts: Positive
    hidden: Positive
    k: Positive
    kinds: list[str]
    renormalize: bool
    timeout_s: Timeout
    seed: Seed


@dataclasses.dataclass(frozen=True)
class RankCase:
    name: str
    rows: list[Count]
    counts: list[int]


@dataclasses.dataclass(frozen=True)
class RefuseCase:
    """A grouped configuration a router must not route as asked (docs/routing.md §3): groups of one
    expert with a correction bias. Refusing it passes (the reference's rule), and so does routing
    it as ungrouped routing (vLLM's fallback); choosing experts by group id fails."""

    name: str
    experts: Positive
    k: Positive
    num_expert_group: Positive
    topk_group: Positive
    rows: Positive
    seed: Seed
    note: str

    def __post_init__(self) -> None:
        if self.experts % self.num_expert_group or not 1 <= self.topk_group <= self.num_expert_group:
            raise ValueError("E must split into num_expert_group equal groups and 1 <= topk_group <= num_expert_group")


_COUNT = re.compile(r"^\s*(?:(-?\d+)|T\s*(?:([-+/])\s*(\d+))?)\s*$")


def resolve_count(expr: str, rows: int) -> int:
    """A count written as an int or an expression of T ("T", "T-1", "T+3", "T/2") -> an int."""
    match = _COUNT.match(expr)
    if match is None:
        raise ValueError(f"count {expr!r}: expected an integer or T, T-n, T+n, T/n")
    if match.group(1) is not None:
        return int(match.group(1))
    op, amount = match.group(2), match.group(3)
    if op is None:
        return rows
    amount = int(amount)
    return {"-": rows - amount, "+": rows + amount, "/": rows // amount}[op]


def count_label(count: int) -> str:
    """`n7`, `n0`, `nminus1`: a count in a case name."""
    return f"n{count}" if count >= 0 else f"nminus{-count}"


def _load_cases() -> dict[str, Any] | Unavailable:
    cases = load_case_file(
        CASE_FILE,
        {
            "tolerances": Table(Tolerance, keyed=True),
            "kind": Table(Kind),
            "groups": Table(Groups),
            "grid": Table(GridSpec, many=False),
            "grid_serving_scale": Table(GridSpec, many=False),
            "edge": Table(EdgeCase),
            "pad": Table(PadSpec, many=False),
            "replay": Table(ReplaySpec, many=False),
            "batch": Table(BatchSpec, many=False),
            "load": Table(LoadSpec, many=False),
            "rank": Table(RankSpec, many=False),
            "rank_case": Table(RankCase),
            "refuse": Table(RefuseCase),
        },
    )
    if isinstance(cases, Unavailable):
        return cases
    try:
        _check_cross_references(cases)
    except CaseFileError as exc:
        if not deferring():
            raise
        return unavailable(CASE_FILE, exc)  # a session that selects no routing test still runs
    return cases


def _check_cross_references(cases: dict[str, Any]) -> None:
    """What the per-table types cannot say: names that must exist, groups that must cover (E, k)."""
    label = str(case_path(CASE_FILE))
    for name in ("weights", "golden", "exact"):
        if name not in cases["tolerances"]:
            raise CaseFileError(f"{label}: table [tolerances.{name}]: missing")
    kinds = {kind.name: kind for kind in cases["kind"]}
    for table in ("grid", "pad", "replay", "batch", "rank"):
        for name in cases[table].kinds:
            if name not in kinds:
                raise CaseFileError(f"{label}: table [{table}] key 'kinds': unknown kind {name!r}; known: {sorted(kinds)}")
    if cases["load"].kind not in kinds:
        raise CaseFileError(f"{label}: table [load] key 'kind': unknown kind {cases['load'].kind!r}")
    seen: dict[tuple[int, int], str] = {}
    for groups in cases["groups"]:
        for k in groups.k:
            where = f"{label}: table [groups] case {groups.name!r}"
            if (groups.experts, k) in seen:
                raise CaseFileError(f"{where}: (E={groups.experts}, k={k}) already given by {seen[groups.experts, k]!r}")
            if groups.experts % groups.num_expert_group or not 1 <= groups.topk_group <= groups.num_expert_group:
                raise CaseFileError(
                    f"{where}: E={groups.experts} must split into num_expert_group equal groups, 1 <= topk_group <= groups"
                )
            if groups.experts == groups.num_expert_group and any(kind.grouped and kind.bias != "none" for kind in kinds.values()):
                raise CaseFileError(
                    f"{where}: E={groups.experts} in {groups.num_expert_group} groups is groups of one expert, which a grouped kind "
                    "with a correction bias cannot route (docs/routing.md §3: both routers refuse it); use fewer groups"
                )
            if k > groups.topk_group * groups.experts // groups.num_expert_group:
                raise CaseFileError(
                    f"{where}: k={k} exceeds the {groups.topk_group * groups.experts // groups.num_expert_group} experts left in the kept groups"
                )
            seen[groups.experts, k] = groups.name
    needed = []
    for table in ("grid", "grid_serving_scale"):
        grid = cases[table]
        for name in grid.kinds:
            if name not in kinds:
                raise CaseFileError(f"{label}: table [{table}] key 'kinds': unknown kind {name!r}; known: {sorted(kinds)}")
        if any(kinds[n].grouped for n in grid.kinds):
            needed += [(e, k) for e in grid.experts for k in grid.k]
    for table in ("pad", "replay", "batch", "rank"):
        spec = cases[table]
        if any(kinds[n].grouped for n in spec.kinds):
            needed.append((spec.experts, spec.k))
    if kinds[cases["load"].kind].grouped:
        needed.append((cases["load"].experts, cases["load"].k))
    for experts, k in needed:
        if (experts, k) not in seen:
            raise CaseFileError(f"{label}: table [groups]: no row for E={experts}, k={k} (a grouped case routes it)")


CASES = _load_cases()
KINDS: dict[str, Kind] = {kind.name: kind for kind in CASES["kind"]}
TOL_WEIGHTS: Tolerance = CASES["tolerances"]["weights"]
TOL_GOLDEN: Tolerance = CASES["tolerances"]["golden"]
TOL_EXACT: Tolerance = CASES["tolerances"]["exact"]


def group_params(experts: int, k: int) -> tuple[int, int]:
    for groups in CASES["groups"]:
        if groups.experts == experts and k in groups.k:
            return groups.num_expert_group, groups.topk_group
    raise CaseFileError(f"{case_path(CASE_FILE)}: table [groups]: no row for E={experts}, k={k}")

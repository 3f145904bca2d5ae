"""Localising a failing routing case to a stage: re-run its `select_experts` call with stage taps.

Only a case whose gate rows failed is re-run (`explain`), so the passing grid costs nothing more.
The target runs eagerly with its adapter's `stage_map` (function taps record in eager runs only),
the reference in fp32 and its golden (`golden=True`: fp64 scores and weights for the experts its
fp32 keys select) with the reference adapter's map; `parity.localise.chain` judges every stage
and blames the first that diverges while its inputs are within bound (docs/localise.md). The
selection stages compare the real rows (before the valid-row count), the only rows the reference
routes; the masked output compares every row.

A defect that shows only in a replayed capture (a count read on the host) has no eager stage to
blame: the chain then says no stage diverged, beside the replay- row that failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from parity.localise.chain import Chain, Side, build_chain
from parity.localise.families.routing import REAL
from parity.localise.observe import Resolved, observe_eager, resolve
from parity.localise.repro import StageSource, write_repro
from parity.localise.rows import write_chain
from parity.localise.vocabulary import vocabulary
from parity.suites.routing.cases import CASES, DTYPES, EdgeCase
from parity.suites.routing.support import (
    Check,
    GridPoint,
    PadPoint,
    count_tensor,
    edge_logits,
    edge_options,
    grid_truth,
    pad_inputs,
)
from reference_models.routing.adapter import ReferenceRouter

VOCABULARY = vocabulary("routing")
REFERENCE = ReferenceRouter()


@dataclasses.dataclass(frozen=True)
class RouteCall:
    """One `select_experts` call of a case, what a localisation re-runs on all three sides."""

    logits: torch.Tensor
    k: int
    options: Mapping[str, Any]
    count: int | None = None  # the valid-row count (None: every row is real)

    @property
    def real(self) -> int:
        rows = self.logits.shape[0]
        return rows if self.count is None else min(max(self.count, 0), rows)


def stage_maps(router: Any) -> tuple[Resolved, Resolved]:
    """The target's map (none declared: every stage not observable) and the reference's."""
    target_map = getattr(router, "stage_map", None) or {}
    return resolve(None, target_map, VOCABULARY, 0), resolve(None, REFERENCE.stage_map, VOCABULARY, 0)


def localise_call(router: Any, call: RouteCall, *, compared: str) -> Chain:
    """The stage chain of `call` on `router` against the reference and its fp64 golden."""
    target_map, reference_map = stage_maps(router)
    _, target_values = observe_eager(
        None, target_map, lambda: router.select_experts(*_target_args(call), **_target_options(call))
    )
    _, reference_values = observe_eager(
        None, reference_map, lambda: REFERENCE.select_experts(call.logits, call.k, **_reference_options(call))
    )
    _, golden_values = observe_eager(
        None, reference_map, lambda: REFERENCE.select_experts(call.logits, call.k, golden=True, **_reference_options(call))
    )
    real = {REAL: torch.arange(call.logits.shape[0]) < call.real}
    return build_chain(
        VOCABULARY,
        target_map=target_map,
        reference_map=reference_map,
        target=Side(target_values, row_sets=real),
        reference=Side(reference_values, row_sets=real),
        golden=Side(golden_values, row_sets=real),
        compared=compared,
    )


def describe(call: RouteCall) -> str:
    """The call's shape and options, for the chain's summary."""
    rows, experts = call.logits.shape
    shown = {key: value for key, value in call.options.items() if key != "correction_bias"}
    bias = ", correction_bias" if call.options.get("correction_bias") is not None else ""
    count = "" if call.count is None else f", {call.real} real rows (count {call.count})"
    options = ", ".join(f"{key}={value}" for key, value in shown.items())
    return f"select_experts(logits [{rows}, {experts}] {str(call.logits.dtype).removeprefix('torch.')}, k={call.k}, {options}{bias}){count}"


class _Seeded:
    """A report whose info rows carry the case's seed, as the case's gate rows do."""

    def __init__(self, report: Any, seed: int | None) -> None:
        self.report, self.seed = report, seed

    def info(self, **row: Any) -> None:
        self.report.info(**row, **({} if self.seed is None else {"seed": self.seed}))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.report, name)


def explain(
    report: Any,
    checks: Sequence[Check],
    router: Any,
    call: Callable[[], RouteCall],
    *,
    case: str,
    seed: int | None = None,
    mode: str = "eager",
    run_dir: Path | None = None,
) -> Chain | None:
    """When a gate row of `checks` failed: the case's stage chain as rows under `case`, and with
    `run_dir` the blamed stage's repro. A passing case returns None without building its inputs
    (the grid's cost is unchanged)."""
    if not any(check.failed for check in checks):
        return None
    made = call()
    chain = localise_call(router, made, compared=f"{case}: {describe(made)}, eager, vs the fp64 golden")
    repro = ""
    if run_dir is not None:
        target_map, reference_map = stage_maps(router)
        repro = write_repro(
            run_dir,
            chain,
            case=case,
            mode=mode,
            target=StageSource(None, target_map, lambda: router.select_experts(*_target_args(made), **_target_options(made))),
            reference=StageSource(
                None, reference_map, lambda: REFERENCE.select_experts(made.logits, made.k, **_reference_options(made))
            ),
        )
    write_chain(_Seeded(report, seed), chain, case=case, mode=mode, repro=repro)
    return chain


def _target_args(call: RouteCall) -> tuple[Any, ...]:
    return call.logits.clone(), call.k


def _target_options(call: RouteCall) -> dict[str, Any]:
    counted = {} if call.count is None else {"num_valid_rows": count_tensor(call.count, call.logits.device)}
    return {**counted, **call.options}


def _reference_options(call: RouteCall) -> dict[str, Any]:
    counted = {} if call.count is None else {"num_valid_rows": call.count}
    return {**counted, **call.options}


# ---- the calls of each case family, rebuilt from the case as its check builds them ----------------


def grid_call(point: GridPoint, device: torch.device, seed: int) -> RouteCall:
    truth = grid_truth(point.kind, point.experts, point.k, point.dtype, point.renormalize, str(device), seed, point.table)
    return RouteCall(truth.logits[: point.rows].clone(), point.k, truth.options)


def edge_call(case: EdgeCase, dtype: str, device: torch.device) -> RouteCall:
    return RouteCall(edge_logits(case).to(DTYPES[dtype]).to(device), case.k, edge_options(case, device))


def pad_call(point: PadPoint, device: torch.device, seed: int) -> RouteCall:
    logits, count, options = pad_inputs(point, device, seed)
    return RouteCall(logits, CASES["pad"].k, options, count)

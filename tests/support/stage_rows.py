"""Stage-chain rows as a localisation writes them, without building a model: a chain of the AR
vocabulary made by hand and written by `parity.localise.rows.write_chain`, so the review's tests
read rows of the writer's own format (a change of it on one side goes red in tests/report)."""

from __future__ import annotations

from typing import Any

from parity.localise.bisect import Bisection, PieceResult
from parity.localise.chain import FAIL, NOT_OBSERVABLE, PASS, Chain, StageError
from parity.localise.rows import write_bisection, write_chain
from parity.localise.vocabulary import vocabulary


class RowCatcher:
    """The `info` half of the suites' report fixture: collects rows for `ReportWriter.write_many`."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def info(self, *, metric: str, value: float | int | None, detail: str = "", verdict: str = "pass", **where: Any) -> None:
        where.setdefault("better", "")
        self.rows.append(dict(metric=metric, value=value, detail=detail, verdict=verdict, kind="info", **where))


def ar_chain(layers: int, *, blamed: str | None = "layer.0.q_rope", undeclared: tuple[str, ...] = ("gen_mlp.act",)) -> Chain:
    """An AR chain over `layers` layers: every stage within bound up to `blamed`, which diverges by
    5e5 times its bound, and every stage after it diverged (inheriting); the stages of `undeclared`
    are not observable. `blamed=None`: no stage diverged."""
    chain = Chain("ar", "prompt mixed, all positions")
    after = False
    for site, stage, layer in vocabulary("ar").chain(layers):
        inputs = tuple(vocabulary("ar").input_sites(stage, layer, layers))
        if stage.name in undeclared:
            chain.stages.append(
                StageError(site, stage.name, layer, NOT_OBSERVABLE, detail="the target's stage_map does not declare it")
            )
            continue
        bound = 1e-7 * (1 + (layer or 0))
        if site == blamed:
            after = True
            chain.stages.append(StageError(site, stage.name, layer, FAIL, 5e5 * bound, bound, stage.what, inputs))
        elif after:
            chain.stages.append(StageError(site, stage.name, layer, FAIL, 300 * bound, bound, stage.what, inputs))
        else:
            chain.stages.append(StageError(site, stage.name, layer, PASS, 0.3 * bound, bound, stage.what, inputs))
    found = chain.stage(blamed) if blamed else None
    if found is not None:
        chain.blamed = StageError(
            found.site, found.stage, found.layer, found.status, found.value, found.bound, found.detail, found.inputs[:1]
        )
    return chain


def chain_rows(
    case: str,
    *,
    suite: str = "numerics",
    mode: str = "eager",
    layers: int = 4,
    blamed: str | None = "layer.0.q_rope",
    repro: str = "",
) -> list[dict[str, Any]]:
    """The rows `write_chain` writes for `ar_chain(layers, blamed=blamed)` under (suite, case, mode)."""
    catcher = RowCatcher()
    write_chain(catcher, ar_chain(layers, blamed=blamed), case=case, mode=mode, repro=repro, suite=suite)
    return catcher.rows


def piece_row(case: str, piece: str | None, *, suite: str = "numerics", mode: str = "compiled") -> dict[str, Any]:
    """The row `write_bisection` writes: the smallest compiled module whose output differs from its
    eager run (`piece`), or that no piece alone does (None)."""
    tried = [PieceResult("", True, 3.2e-3, 4e-7), PieceResult("ar.language_model.model", True, 3.2e-3, 4e-7)]
    found = PieceResult(piece, True, 3.2e-3, 4e-7) if piece else None
    catcher = RowCatcher()
    write_bisection(catcher, Bisection(tried + ([found] if found else []), found), case=case, mode=mode, suite=suite)
    (row,) = catcher.rows
    return row


def failing_gate(case: str, *, suite: str = "numerics", mode: str = "eager", site: str = "logits") -> dict[str, Any]:
    """The failing gate row a chain explains."""
    return dict(
        suite=suite,
        case=case,
        mode=mode,
        site=site,
        metric="rmse_vs_golden",
        value=2e-2,
        threshold=1e-6,
        verdict="fail",
        bound="measured",
        detail="above noise floor",
    )

"""A stage chain as report rows: one info row per stage and one naming the stage blamed.

Written only for a case whose gate rows failed (an info row recording a divergence beside passing
gates would be a failure hidden as info), so every row here sits beside the failure it explains.
"""

from __future__ import annotations

from typing import Any

from parity.compare import FAIL, FIXED, MEASURED, NOT_APPLICABLE, PASS
from parity.localise.bisect import Bisection
from parity.localise.chain import FAIL as DIVERGED
from parity.localise.chain import PASS as WITHIN
from parity.localise.chain import Chain

STAGE_METRIC = "stage_rmse_vs_golden"
EXACT_METRIC = "stage_mismatches"
BLAME_METRIC = "first_diverging_stage"
PIECE_METRIC = "compile_only_piece"


def write_chain(report: Any, chain: Chain, *, case: str, mode: str, repro: str = "", suite: str | None = None) -> None:
    """The chain's rows under the failing case (`repro`: the repro's path, relative to the run)."""
    where: dict[str, Any] = {"case": case, "mode": mode}
    if suite is not None:
        where["suite"] = suite
    for stage in chain.stages:
        if not stage.judged:
            report.info(
                metric=STAGE_METRIC,
                value=None,
                verdict=NOT_APPLICABLE,
                site=stage.site,
                detail=f"{stage.status}: {stage.detail}",
                data={"status": stage.status},
                **where,
            )
            continue
        exact = stage.bound == 0.0 and stage.detail.endswith("(exact stage)")
        report.info(
            metric=EXACT_METRIC if exact else STAGE_METRIC,
            value=stage.value,
            threshold=stage.bound,
            bound=FIXED if exact else MEASURED,  # an exact stage's bound is 0; a float stage's, the reference's own error here
            verdict=PASS if stage.status == WITHIN else FAIL,
            site=stage.site,
            detail=stage.detail,
            **where,
        )
    blamed = chain.blamed
    summary = chain.summary()
    report.info(
        metric=BLAME_METRIC,
        value=0 if blamed is None else 1,
        verdict=FAIL if blamed is not None and blamed.status == DIVERGED else PASS,
        site="" if blamed is None else blamed.site,
        detail=summary + (f"; repro: {repro}" if repro else ""),
        data={"summary": summary, "repro": repro},
        **where,
    )


def write_bisection(report: Any, bisection: Bisection, *, case: str, mode: str, suite: str | None = None) -> None:
    """The compile-only piece (or that none alone differs) under the failing case."""
    where: dict[str, Any] = {"case": case, "mode": mode}
    if suite is not None:
        where["suite"] = suite
    piece = bisection.piece
    report.info(
        metric=PIECE_METRIC,
        value=0 if piece is None else 1,
        verdict=PASS if piece is None else FAIL,
        site="" if piece is None else piece.path,
        detail=bisection.summary(),
        **where,
    )

"""Routing suite, edge rows: exact ties (`tie-`), candidates (`nan-`: NaN, ±inf, fewer than k
finite logits, group masks), pad rows past the device-side valid-row count (`pad-`) and grouped
configurations a router must not route as asked (`refuse-`: groups of one expert with a bias).

tie- / nan-: hand-built rows with hand-written expected ids (docs/routing.md R2-R4), on fp32 and
bf16 logits; the target must give exactly those ids, the reference's ids, weights within docs/routing.md §2's
bound, and keep the output contract. pad-: for counts 0, 1, T-1, T (and T+3, -1, which clamp) with
garbage or NaN logits in the pad rows, pads are -1 / 0 in every column and real rows equal an
unpadded run bit for bit (R6, R8). refuse-: refused (the reference's rule) or routed as ungrouped
routing, never by group id (docs/routing.md §3). A failing tie-, nan- or pad- case is re-run with
stage taps and its first diverging stage named (`parity/suites/routing/localise.py`).
"""

from __future__ import annotations

import pytest

from parity.suites.routing.cases import CASES, EdgeCase, RefuseCase
from parity.suites.routing.localise import edge_call, explain, pad_call
from parity.suites.routing.support import PadPoint, edge_cases, edge_rows, pad_points, pad_rows, refuse_rows, write_rows

pytestmark = pytest.mark.parity_suite("routing")

EDGES = edge_cases()
PADS = pad_points()


@pytest.mark.parametrize("case,dtype", EDGES, ids=[f"{case.name}-{dtype}" for case, dtype in EDGES])
def test_edge_rows(case: EdgeCase, dtype: str, report, target, device, run_dir) -> None:
    router = target.router()
    rows = edge_rows(router, case, dtype, device)
    write_rows(report, rows)
    explain(
        report, rows, router, lambda: edge_call(case, dtype, device), case=f"{case.name}-{dtype}", run_dir=run_dir
    )  # a failing case only


@pytest.mark.parametrize("point", PADS, ids=[point.name(CASES["pad"].rows) for point in PADS])
def test_pad_rows(point: PadPoint, report, target, device, settings, run_dir) -> None:
    seed = CASES["pad"].seed + settings.seed
    router = target.router()
    rows = pad_rows(router, point, device, seed)
    write_rows(report, rows, seed=seed)
    explain(
        report,
        rows,
        router,
        lambda: pad_call(point, device, seed),
        case=point.name(CASES["pad"].rows),
        seed=seed,
        run_dir=run_dir,
    )


@pytest.mark.parametrize("case", CASES["refuse"], ids=[case.name for case in CASES["refuse"]])
def test_refused_configurations(case: RefuseCase, report, target, device, settings) -> None:
    seed = case.seed + settings.seed
    write_rows(report, refuse_rows(target.router(), case, device, seed), seed=seed)

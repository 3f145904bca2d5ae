"""Routing suite, random sweep (`grid-` cases): the target's router against the reference.

512 points: E {8, 40, 64, 256} x k {1, 2, 4, 8} x T {1, 7, 64, 513} x fp32 / bf16 logits x
renormalize on / off x softmax (docs/routing.md §2) / grouped sigmoid with a negative correction
bias (docs/routing.md §3). Per point: the output contract, ids (fp32: equal to the reference's;
bf16: every differing decision audited by its margin, docs/tolerances.md §3), weights within the
bound of docs/routing.md §2 of the reference where the ids agree, and the noise-floor rule against
the reference's fp64 golden weights. Parameters and tolerances: `cases/routing.toml`. A failing
point is re-run with stage taps and its first diverging stage named (`parity/suites/routing/localise.py`).
"""

from __future__ import annotations

import pytest

from parity.suites.routing.cases import CASES
from parity.suites.routing.localise import explain, grid_call
from parity.suites.routing.support import GridPoint, grid_points, grid_rows, write_rows

pytestmark = pytest.mark.parity_suite("routing")

POINTS = grid_points()
SERVING_SCALE = grid_points("grid_serving_scale")


@pytest.mark.parametrize("point", POINTS + SERVING_SCALE, ids=[point.name for point in POINTS + SERVING_SCALE])
def test_grid(point: GridPoint, report, target, device, settings, run_dir) -> None:
    if point.table == "grid_serving_scale" and settings.size != "full":
        pytest.skip("serving-scale routing points run in the full-size lane (--size full)")
    seed = CASES[point.table].seed + settings.seed
    router = target.router()
    rows = grid_rows(router, point, device, seed)
    write_rows(report, rows, seed=seed)
    explain(
        report, rows, router, lambda: grid_call(point, device, seed), case=point.name, seed=seed, run_dir=run_dir
    )  # a failing case only

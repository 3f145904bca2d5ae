"""Routing suite, consumers of the ids (`load-`): the expert-load counter counts routes of real
rows only (pad rows skipped by the device-side count, even when they hold valid-looking ids) and
the EPLB remap passes -1 and ids outside [0, E) through (docs/routing.md §4, §6)."""

from __future__ import annotations

import pytest

from parity.suites.routing.cases import CASES
from parity.suites.routing.support import load_name, load_points, load_rows, write_rows

pytestmark = pytest.mark.parity_suite("routing")

POINTS = load_points()


@pytest.mark.parametrize("rows,replicas,count", POINTS, ids=[load_name(*point) for point in POINTS])
def test_load_and_remap(rows: int, replicas: int, count: int, report, target, device, settings) -> None:
    seed = CASES["load"].seed + settings.seed
    write_rows(report, load_rows(target.router(), rows, replicas, count, device, seed), seed=seed)

"""Routing suite, two ranks (`rank-`): routing on the rank that owns the rows and then gathering
rows with their ids and weights equals gathering the rows and routing afterwards (ROCm/ATOM#2725).

The target's own distributed path runs through its router adapter (`route_then_gather`,
`gather_then_route`) in 2 spawned processes: gloo on CPU tensors, or NCCL when `--device cuda` sees
two GPUs (NVLink multicast off in the children). The parent compares the two paths bit for bit and
each with the reference routed per rank, and checks rows stay aligned with their ids. One spawn
serves every case; the backend is in each row's detail.
"""

from __future__ import annotations

import pytest

from parity.suites.routing.cases import CASES
from parity.suites.routing.ranks import RankJob, choose_backend, missing_members, rank_case_names, rank_rows, run_ranks
from parity.suites.routing.support import write_rows

pytestmark = pytest.mark.parity_suite("routing")


def test_route_then_gather_equals_gather_then_route(report, target, device, settings, tmp_path) -> None:
    router = target.router()
    missing = missing_members(router, ("route_then_gather", "gather_then_route"))
    if missing:
        pytest.skip(f"{router.name} router has no multi-rank entry points ({', '.join(missing)}): rank- cases do not apply")
    spec = CASES["rank"]
    seed = spec.seed + settings.seed
    backend, note = choose_backend(device)
    job = RankJob(settings.target, backend, str(tmp_path / "rendezvous"), str(tmp_path), seed, spec.timeout_s)
    results = run_ranks(job)
    for case, kind in rank_case_names():
        write_rows(report, rank_rows(case, kind, results, seed, note), seed=seed)

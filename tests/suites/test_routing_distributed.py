"""Routing on the rank that owns the rows, then gathering rows with their ids and weights, equals
gathering the rows and routing afterwards (2 gloo processes on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from serving_models.routing import distributed as routing_distributed

WORLD_SIZE = 2
CAPACITY = 12
NUM_EXPERTS, HIDDEN, K = 16, 8, 4
# Rank-local (rows, n_valid): rank 0 has pad rows and a count past its rows, rank 1 a short
# block (padded up to capacity by the gather) with a -1 count on the second case.
CASES = [((10, 7), (12, 12)), ((12, 15), (5, -1)), ((3, 0), (12, 1))]
ROUTINGS = [
    dict(renormalize=True, num_shared_experts=1),
    dict(scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
]


def local_inputs(rank: int, rows: int, n_valid: int, seed: int):
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    hidden = torch.randn(rows, HIDDEN, generator=generator)
    logits = torch.randn(rows, NUM_EXPERTS, generator=generator)
    logits[::3] = logits[::3].round()  # exact ties
    real = min(max(n_valid, 0), rows)
    logits[real:] = float("nan")  # pad rows: garbage
    return hidden, logits, torch.tensor([n_valid], dtype=torch.int32)


def equal(a: routing_distributed.GatheredRoutes, b: routing_distributed.GatheredRoutes) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("hidden", "weights", "ids", "counts"))


def worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        bias = -torch.rand(NUM_EXPERTS, generator=torch.Generator().manual_seed(1)) - 1
        for seed, case in enumerate(CASES):
            rows, n_valid = case[rank]
            hidden, logits, count = local_inputs(rank, rows, n_valid, seed)
            for routing in ROUTINGS:
                kwargs = dict(routing, correction_bias=bias) if routing.get("scoring") == "sigmoid" else routing
                before = routing_distributed.route_then_gather(hidden, logits, count, K, capacity=CAPACITY, **kwargs)
                after = routing_distributed.gather_then_route(hidden, logits, count, K, capacity=CAPACITY, **kwargs)
                assert equal(before, after), f"rank {rank}, case {case}, {routing}: route-then-gather != gather-then-route"
                counts = [min(max(n, 0), r) for r, n in case]
                assert before.counts.tolist() == counts
                for owner, real in enumerate(counts):  # pad rows carry no route after the gather
                    block = before.ids[owner * CAPACITY : (owner + 1) * CAPACITY]
                    assert (block[real:] == -1).all() and (block[:real, 0] >= 0).all()

        # The comparison can fail: routing the gathered rows without the per-rank pad mask differs.
        hidden, logits, count = local_inputs(rank, *CASES[0][rank], seed=0)
        before = routing_distributed.route_then_gather(hidden, logits, count, K, capacity=CAPACITY, **ROUTINGS[0])
        unmasked = routing_distributed.routing.select_experts(
            routing_distributed.all_gather_rows(routing_distributed.pad_rows_to(logits, CAPACITY, 0.0)), K, **ROUTINGS[0]
        )
        assert not torch.equal(before.ids, unmasked.ids), "an unmasked gather-then-route must differ"
    finally:
        dist.destroy_process_group()


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_route_then_gather_equals_gather_then_route(tmp_path):
    # Spawned processes: a fresh interpreter per rank, nothing inherited from pytest's process.
    mp.start_processes(worker, args=(str(tmp_path / "init"),), nprocs=WORLD_SIZE, join=True, start_method="spawn")

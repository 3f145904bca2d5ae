"""The `rank-` family of the `routing` suite: route on the rank that owns the rows, then gather.

The parent spawns `WORLD_SIZE` processes (gloo on CPU tensors, or NCCL on two GPUs with NVLink
multicast off); each loads the target again from the `--target` spec (a mutant factory patches its
own process) and runs every rank- case through the router adapter's `route_then_gather` and
`gather_then_route`, saving the gathered tensors. The parent builds the truth from the reference
(each rank's rows routed with its own count, laid out rank-major at `capacity` rows a rank) and
writes the rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parity.compare import AT_MOST, ERROR, Verdict, count_rule
from parity.observe.progress import Stalled, StallWatch, stall_limit
from parity.suites.routing.cases import CASES, KINDS, TOL_EXACT, TOL_WEIGHTS, RankCase, RankSpec
from parity.suites.routing.support import (
    Check,
    count_tensor,
    fill_pad_rows,
    generator,
    ids_row,
    make_bias,
    routing_options,
    rows_text,
    weights_row,
)
from reference_models.routing import router as reference

WORLD_SIZE = 2
GATHERED_FIELDS = ("hidden", "weights", "ids", "counts")
# NVLink multicast must stay off on the lent machines (NCCL NVLS, symmetric-memory multicast).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@dataclasses.dataclass(frozen=True)
class RankJob:
    """What a spawned rank needs: the target spec (loaded again in the child), where to meet, where to write."""

    target: str
    backend: Literal["gloo", "nccl"]
    init_file: str
    out_dir: str
    seed: int
    timeout_s: float


def rank_case_names() -> list[tuple[RankCase, str]]:
    return [(case, kind) for case in CASES["rank_case"] for kind in CASES["rank"].kinds]


def rank_case_name(case: RankCase, kind: str) -> str:
    return f"rank-{kind}-{case.name}"


def rank_inputs(
    case: RankCase, kind_name: str, rank: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, int, dict[str, Any]]:
    """This rank's hidden rows, logits (every third row integer-valued; rows past the count NaN),
    its count and the routing options: the same on every process for the same arguments."""
    spec: RankSpec = CASES["rank"]
    kind = KINDS[kind_name]
    rows, count = case.rows[rank], case.counts[rank]
    gen = generator(seed, rank, rows, count + 10)
    hidden = torch.randn(rows, spec.hidden, generator=gen)
    logits = 2.0 * torch.randn(rows, spec.experts, generator=gen)
    logits[::3] = logits[::3].round()
    fill_pad_rows(logits, min(max(count, 0), rows), "nan", gen)
    options = routing_options(kind, spec.experts, spec.k, spec.renormalize, make_bias(kind, spec.experts, seed, device))
    return hidden.to(device), logits.to(device), count, options


def _to_cpu(gathered: Any) -> dict[str, torch.Tensor]:
    return {field: getattr(gathered, field).detach().cpu() for field in GATHERED_FIELDS}


def rank_worker(rank: int, job: RankJob) -> None:
    """One rank: route every rank- case both ways through the target's adapter, save to out_dir."""
    from parity.target import resolve_target

    torch.set_num_threads(1)
    beat = Path(job.out_dir) / f"rank{rank}.alive"  # its heartbeat: touched at each step the parent waits through
    beat.touch()
    device = torch.device("cuda", rank) if job.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        job.backend,
        init_method=f"file://{job.init_file}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=job.timeout_s),
    )
    results: dict[str, Any] = {}
    beat.touch()
    try:
        router = resolve_target(job.target).router()
        spec: RankSpec = CASES["rank"]
        for case, kind in rank_case_names():
            hidden, logits, count, options = rank_inputs(case, kind, rank, device, job.seed)
            try:
                both = {}
                for path in ("route_then_gather", "gather_then_route"):
                    gathered = getattr(router, path)(
                        hidden, logits, count_tensor(count, device), spec.k, capacity=spec.capacity, **options
                    )
                    both[path] = _to_cpu(gathered)
                results[rank_case_name(case, kind)] = both
                beat.touch()
            except Exception as error:  # recorded per case; a failed collective ends the loop
                results[rank_case_name(case, kind)] = {"error": f"rank {rank}: {type(error).__name__}: {error}"}
                break
    finally:
        torch.save(results, Path(job.out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for processes started inside (spawned children copy os.environ)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def choose_backend(device: torch.device) -> tuple[Literal["gloo", "nccl"], str]:
    """NCCL on CUDA with >= 2 GPUs; gloo on CPU tensors otherwise (and say why)."""
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        if gpus >= WORLD_SIZE:
            return "nccl", f"nccl on cuda:0, cuda:1 ({gpus} GPUs; NVLS and symmetric-memory multicast off)"
        return "gloo", f"gloo on CPU tensors: {gpus} CUDA device(s), NCCL needs {WORLD_SIZE}"
    return "gloo", "gloo on CPU tensors"


def run_ranks(job: RankJob) -> dict[int, dict[str, Any]]:
    """Spawn the ranks, wait while they make progress (each touches its heartbeat at every step; a
    collective that hangs is bounded by `job.timeout_s`), return each rank's saved results. No time
    limit of the whole: a loaded machine makes the ranks slow, and only ranks that stopped making
    progress for the stall limit are stopped (docs/cli.md §9)."""
    with _environment(CHILD_ENV):
        context = mp.start_processes(rank_worker, args=(job,), nprocs=WORLD_SIZE, join=False, start_method="spawn")
    progress = StallWatch(stall_limit(), [Path(job.out_dir)])
    while not context.join(timeout=0.5):
        if progress.stalled():
            for process in context.processes:  # only the processes started above
                if process.is_alive():
                    process.terminate()
            raise Stalled(f"the {WORLD_SIZE} rank workers ({job.backend})", progress.limit, watched=progress.paths)
    return {rank: _rank_results(Path(job.out_dir) / f"rank{rank}.pt", rank) for rank in range(WORLD_SIZE)}


def _rank_results(path: Path, rank: int) -> dict[str, Any]:
    """What rank `rank` saved: tensors, numbers and strings only (`weights_only=True`: loading runs
    no pickled code, whoever wrote the file)."""
    if not path.is_file():
        raise RuntimeError(f"rank {rank} wrote no results ({path} missing): the rank process died before saving")
    return torch.load(path, weights_only=True)


def expected_gather(case: RankCase, kind: str, seed: int) -> dict[str, torch.Tensor]:
    """The truth: each rank's rows routed by the reference with its own count, laid out rank-major
    at `capacity` rows a rank, pad rows -1 / 0; plus which gathered rows are real."""
    spec: RankSpec = CASES["rank"]
    blocks = {"hidden": [], "weights": [], "ids": [], "real": []}
    counts = []
    for rank in range(WORLD_SIZE):
        hidden, logits, count, options = rank_inputs(case, kind, rank, torch.device("cpu"), seed)
        real = min(max(count, 0), logits.shape[0])
        routed = reference.select_experts(logits, spec.k, num_valid_rows=count, **options)
        pad = spec.capacity - logits.shape[0]
        width = routed.ids.shape[1]
        blocks["hidden"].append(torch.cat([hidden, torch.zeros(pad, spec.hidden)]))
        blocks["weights"].append(torch.cat([routed.weights, torch.zeros(pad, width)]))
        blocks["ids"].append(torch.cat([routed.ids, torch.full((pad, width), -1, dtype=torch.int32)]))
        blocks["real"].append(torch.arange(spec.capacity) < real)
        counts.append(real)
    expected = {key: torch.cat(parts) for key, parts in blocks.items()}
    expected["counts"] = torch.tensor(counts, dtype=torch.int64)
    return expected


def rank_rows(case: RankCase, kind: str, results: dict[int, dict[str, Any]], seed: int, backend_note: str) -> list[Check]:
    """route_then_gather == gather_then_route bit for bit; both equal the per-rank reference laid
    out rank-major; rows stay aligned with their ids; counts gathered; both ranks agree."""
    name = rank_case_name(case, kind)
    errors = [results[rank].get(name, {}).get("error") for rank in range(WORLD_SIZE)]
    missing = [rank for rank in range(WORLD_SIZE) if name not in results[rank]]
    if any(errors) or missing:
        text = "; ".join(e for e in errors if e) or f"ranks {missing} produced no result (an earlier case failed)"
        return [Check(name, Verdict(ERROR, "rank_run", None, None, f"{text} [{backend_note}]"))]
    expected = expected_gather(case, kind, seed)
    real = expected["real"]
    mine = results[0][name]
    rows = []
    note = f"[{backend_note}]"

    disagree = [
        f"{path}.{field}"
        for path in mine
        for field in GATHERED_FIELDS
        if not torch.equal(mine[path][field], results[1][name][path][field])
    ]
    rows.append(
        Check(
            name,
            count_rule(
                len(disagree),
                0,
                metric="ranks_disagree",
                at=AT_MOST,
                detail=f"rank 0 vs rank 1 gathered tensors: {', '.join(disagree) or 'identical'} {note}",
            ),
        )
    )
    before, after = mine["route_then_gather"], mine["gather_then_route"]
    rows.append(ids_row(name, before["ids"], after["ids"], site="gather_then_route", what="route_then_gather result"))
    rows.append(weights_row(name, before["weights"], after["weights"], TOL_EXACT, site="gather_then_route", note=note))
    rows.append(ids_row(name, expected["ids"], before["ids"], site="reference", what="reference routed per rank"))
    rows.append(weights_row(name, expected["weights"], before["weights"], TOL_WEIGHTS, site="reference", note=note))
    for path, got in (("route_then_gather", before), ("gather_then_route", after)):
        shape_ok = got["hidden"].shape == expected["hidden"].shape
        misaligned = (
            (got["hidden"][real] != expected["hidden"][real]).any(dim=1).nonzero().flatten()
            if shape_ok
            else torch.arange(int(real.sum()))
        )
        rows.append(
            Check(
                name,
                count_rule(
                    int(misaligned.numel()),
                    0,
                    metric="rows_misaligned",
                    at=AT_MOST,
                    detail=f"real gathered rows whose hidden state is not the owner's row: {rows_text(misaligned) or 'none'} {note}",
                ),
                path,
            )
        )
        counts_ok = torch.equal(got["counts"].to(torch.int64).reshape(-1), expected["counts"])
        rows.append(
            Check(
                name,
                count_rule(
                    0 if counts_ok else 1,
                    0,
                    metric="counts_mismatch",
                    at=AT_MOST,
                    detail=f"gathered counts {got['counts'].tolist()} vs clamp(n_valid, 0, rows) {expected['counts'].tolist()} {note}",
                ),
                path,
            )
        )
    return rows


def missing_members(router: Any, members: Sequence[str]) -> list[str]:
    """Adapter members a router lacks (the rank- cases need the optional distributed entry points)."""
    return [member for member in members if not callable(getattr(router, member, None))]

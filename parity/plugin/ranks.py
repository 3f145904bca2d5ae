"""Tensor-parallel sessions (`--parity-tp N`): one pytest session per rank, in lockstep.

A sharded target computes with collectives, so every rank must run the same forwards in the same
order. The session the user starts is rank 0: it starts ranks 1..N-1 as pytest sessions of the
same command line (same tests, same order: no xdist), each writing its own rows under
`<run_dir>/ranks/rank-<r>/` and its output to `<run_dir>/ranks/rank-<r>.log`. Every rank builds
the single-process reference and golden itself and judges the target's outputs, which are whole
on every rank (the target gathers or sums them), so every rank computes the same rows; rank 0's
are the run's, and at the end it checks that each other rank's verdicts are its own.

The ranks meet through a rendezvous file (gloo on CPU tensors; NCCL on CUDA, one GPU a rank,
NVLink multicast off) with a timeout on every collective (`PARITY_TP_TIMEOUT_S`, 300 s by
default). A rank that dies ends the run: rank 0 watches its peers and stops the session after
the test in flight, naming the rank, its exit status and its log; a peer whose rank 0 is gone
exits. The factory of the target gets `tp=TensorParallel(rank, world_size, group)`
(docs/targets.md §11).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

RANK_ENV = "PARITY_TP_RANK"
INIT_ENV = "PARITY_TP_INIT"
PARENT_ENV = "PARITY_TP_PARENT"
TIMEOUT_ENV = "PARITY_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
# The ranks meet once, at the target's resolution: the peers are fresh interpreters that import
# torch and collect the suites first, seconds behind rank 0 on a busy machine, whatever the
# collectives' timeout.
RENDEZVOUS_MIN_S = 120.0
RANKS_DIR = "ranks"
# NVLink multicast must stay off on the lent GPU machines (NCCL NVLS, symmetric-memory multicast).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Exit statuses of a peer session that are verdicts (its tests passed or failed), not a dead rank.
VERDICT_EXITS = (0, 1)

GROUP = pytest.StashKey["RankGroup"]()
ACTIVE: RankGroup | None = None  # this process's group while a tensor-parallel session runs
# Suites only rank 0 runs: the mutant catalogues' sessions start their own tensor-parallel groups.
RANK0_ONLY_SUITES = ("sensitivity", "target_mutants")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """What a sharded target's factory receives: this process's rank, the group's size, the group."""

    rank: int
    world_size: int
    group: Any  # torch.distributed.ProcessGroup


def timeout_s() -> float:
    text = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        raise pytest.UsageError(f"{TIMEOUT_ENV}={text!r}: expected seconds (a number > 0)") from None
    if value <= 0:
        raise pytest.UsageError(f"{TIMEOUT_ENV}={text!r}: expected seconds (a number > 0)")
    return value


def this_rank() -> int:
    """This process's rank: its peers are started with `PARITY_TP_RANK`; the session a user starts is 0."""
    return int(os.environ.get(RANK_ENV, "0"))


@dataclasses.dataclass
class Peer:
    rank: int
    process: subprocess.Popen
    log: Path
    run_dir: Path


class RankGroup:
    """The tensor-parallel ranks of this session: the peers rank 0 started, the process group."""

    def __init__(self, world_size: int, rank: int, init_file: Path, device: str) -> None:
        self.world_size = world_size
        self.rank = rank
        self.init_file = init_file
        self.device = device
        self.peers: list[Peer] = []
        self.dead: str | None = None  # why the group broke, once a peer died
        self._tp: TensorParallel | None = None
        self._stop = threading.Event()

    # ---- rank 0: starting and watching the peers ----

    @classmethod
    def start(cls, config: pytest.Config, world_size: int, run_dir: Path, device: str) -> RankGroup:
        """Rank 0: start ranks 1..N-1 as pytest sessions of this command line."""
        numprocesses = config.getoption("numprocesses", None)
        if numprocesses not in (None, 0, "0"):
            raise pytest.UsageError(
                f"--parity-tp {world_size} with -n {numprocesses}: every rank must run the same tests in the same "
                "order, so a tensor-parallel session takes no xdist workers (leave -n out)"
            )
        if config.getoption("parity_append", False):
            raise pytest.UsageError(f"--parity-tp {world_size} with --parity-append: a tensor-parallel run is written whole")
        init_file = Path(tempfile.mkdtemp(prefix="parity-tp-")) / "rendezvous"
        group = cls(world_size, 0, init_file, device)
        ranks_dir = run_dir / RANKS_DIR
        ranks_dir.mkdir(parents=True, exist_ok=True)
        args = list(config.invocation_params.args)
        for rank in range(1, world_size):
            log = ranks_dir / f"rank-{rank}.log"
            argv = [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "--parity-no-summary"]
            argv += ["--parity-report-dir", str(ranks_dir), "--parity-run-id", f"rank-{rank}", "--parity-overwrite"]
            env = {**os.environ, RANK_ENV: str(rank), INIT_ENV: str(init_file), PARENT_ENV: str(os.getpid())}
            if device == "cuda":
                env.update(NCCL_ENV)
            with log.open("w") as out:
                process = subprocess.Popen(argv, cwd=config.invocation_params.dir, env=env, stdout=out, stderr=subprocess.STDOUT)
            group.peers.append(Peer(rank, process, log, ranks_dir / f"rank-{rank}"))
        return group

    @classmethod
    def join(cls, world_size: int, device: str) -> RankGroup:
        """A peer rank: meet rank 0, and exit if rank 0's process goes away."""
        group = cls(world_size, this_rank(), Path(os.environ[INIT_ENV]), device)
        parent = int(os.environ.get(PARENT_ENV, "0"))
        if parent:
            threading.Thread(target=group._exit_without_parent, args=(parent,), daemon=True).start()
        return group

    def _exit_without_parent(self, parent: int) -> None:
        while not self._stop.wait(1.0):
            if os.getppid() != parent:
                sys.stderr.write(f"parity: rank {self.rank}: rank 0 (pid {parent}) is gone; this rank exits\n")
                sys.stderr.flush()
                os._exit(3)

    def watch(self, session: pytest.Session) -> None:
        """Rank 0: stop the session after the test in flight as soon as a peer dies."""
        if self.peers:
            threading.Thread(target=self._watch, args=(session,), daemon=True).start()

    def _watch(self, session: pytest.Session) -> None:
        while not self._stop.wait(0.5):
            for peer in self.peers:
                code = peer.process.poll()
                if code is not None and code not in VERDICT_EXITS:
                    self.dead = f"rank {peer.rank} exited with status {code} during the session (its output: {peer.log})"
                    session.shouldstop = f"tensor-parallel group broken: {self.dead}"
                    return

    def collective_failed(self, session: pytest.Session, nodeid: str, exc: BaseException, tb: Any) -> None:
        """Any rank: a test whose collective failed (timed out on a hung rank, or lost a dead one)
        leaves the group unusable, so the session stops after it instead of timing out test by test."""
        if not raised_by_a_collective(exc, tb):
            return
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        why = f"a collective failed in {nodeid} on rank {self.rank} ({first})"
        self.dead = self.dead or why
        session.shouldstop = f"tensor-parallel group broken: {why}"

    # ---- every rank: the process group ----

    def tensor_parallel(self) -> TensorParallel:
        """Meet the other ranks (once) and return what the factory receives."""
        if self._tp is None:
            import torch
            import torch.distributed as dist

            backend = "nccl" if self.device == "cuda" else "gloo"
            if self.device == "cuda":
                torch.cuda.set_device(self.rank)
            meet_s = max(timeout_s(), RENDEZVOUS_MIN_S)
            try:
                dist.init_process_group(
                    backend,
                    init_method=f"file://{self.init_file}",
                    rank=self.rank,
                    world_size=self.world_size,
                    timeout=datetime.timedelta(seconds=meet_s),
                )
                # the group the target computes in: every collective bounded by the run's timeout
                group = dist.new_group(list(range(self.world_size)), timeout=datetime.timedelta(seconds=timeout_s()))
            except RuntimeError as exc:
                from parity.target import TargetError

                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                logs = ", ".join(str(peer.log) for peer in self.peers) or "rank 0's terminal"
                raise TargetError(
                    f"--parity-tp {self.world_size}: rank {self.rank} did not meet the other ranks within {meet_s:.0f} s "
                    f"({type(exc).__name__}: {first}); their output: {logs}"
                ) from None
            self._tp = TensorParallel(self.rank, self.world_size, group)
        return self._tp

    # ---- the end ----

    def finish(self, grace_s: float | None = None) -> list[str]:
        """Rank 0: wait for the peers (a peer still running `grace_s` after rank 0 ended, by default
        one collective timeout, is hung: it is stopped); one line per rank that did not end with a
        verdict. Every rank: leave the group."""
        global ACTIVE
        ACTIVE = None
        self._stop.set()
        grace_s = timeout_s() if grace_s is None else grace_s
        problems = []
        deadline = time.monotonic() + grace_s
        for peer in self.peers:
            try:
                code = peer.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                peer.process.kill()
                peer.process.wait()
                problems.append(
                    f"rank {peer.rank} was still running {grace_s:.0f} s after rank 0 ended and was stopped (its output: {peer.log})"
                )
                continue
            if code not in VERDICT_EXITS:
                problems.append(f"rank {peer.rank} exited with status {code} (its output: {peer.log})")
        if self._tp is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        with_file = self.init_file.parent
        if self.rank == 0 and with_file.name.startswith("parity-tp-"):
            for leftover in with_file.glob("*"):
                leftover.unlink(missing_ok=True)
            with_file.rmdir()
        return problems

    def stop_peers(self) -> None:
        for peer in self.peers:
            if peer.process.poll() is None:
                peer.process.kill()


# What a failed gloo or NCCL collective raises: a RuntimeError (DistBackendError on recent torch)
# with the backend's own words, "Timed out waiting ...ms for recv" or "Connection closed by peer".
_BACKEND_WORDS = ("gloo", "nccl", "connection closed by peer", "timed out waiting")


def raised_by_a_collective(exc: BaseException, tb: Any) -> bool:
    """Whether `exc` came out of torch.distributed (a collective or its wait), not the test's own check."""
    import traceback

    distributed = any("torch/distributed/" in frame.filename.replace("\\", "/") for frame in traceback.extract_tb(tb))
    text = str(exc).lower()
    return distributed or (isinstance(exc, RuntimeError) and any(word in text for word in _BACKEND_WORDS))


def configure(config: pytest.Config, world_size: int, run_dir: Path, device: str) -> RankGroup | None:
    """The session's rank group (None for a single-process run), stashed on the config."""
    if world_size < 1:
        raise pytest.UsageError(f"--parity-tp {world_size}: the tensor-parallel size must be at least 1")
    if world_size == 1:
        return None
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < world_size:
            raise pytest.UsageError(
                f"--parity-tp {world_size} on cuda: {torch.cuda.device_count()} GPU(s) visible, one per rank needed"
            )
    group = RankGroup.join(world_size, device) if RANK_ENV in os.environ else RankGroup.start(config, world_size, run_dir, device)
    config.stash[GROUP] = group
    global ACTIVE
    ACTIVE = group
    return group


def disagreements(run_dir: Path, group: RankGroup, limit: int = 5) -> list[str]:
    """Rank 0: where a peer's gate verdicts differ from rank 0's (every rank judges whole outputs,
    so a difference means the ranks computed different things: a rank-dependent input or a
    collective that is not one). One line per disagreeing rank, naming its first rows."""
    from parity.report.rows import RESULTS_FILE, ReportError, read_results

    keys = ["suite", "case", "mode", "site", "metric"]

    def verdicts(path: Path) -> Any:
        rows = read_results(path)
        gates = rows[(rows["kind"] == "gate") & ~rows["suite"].isin(RANK0_ONLY_SUITES)][[*keys, "verdict"]].copy()
        gates["_n"] = gates.groupby(keys, sort=False).cumcount()
        return gates.set_index([*keys, "_n"])["verdict"]

    mine_path = run_dir / RESULTS_FILE
    if not mine_path.is_file():
        return []
    mine = verdicts(mine_path)
    lines = []
    for peer in group.peers:
        theirs_path = peer.run_dir / RESULTS_FILE
        try:
            theirs = verdicts(theirs_path)
        except (OSError, ReportError) as exc:
            lines.append(f"rank {peer.rank} wrote no readable rows ({exc}; its output: {peer.log})")
            continue
        both = mine.to_frame("rank0").join(theirs.to_frame("peer"), how="outer")
        differ = both[both["rank0"].fillna("(none)") != both["peer"].fillna("(none)")]
        if len(differ):
            first = "; ".join(
                f"{'/'.join(str(k) for k in key[:3] if k)} {key[4]}: rank 0 {row.rank0}, rank {peer.rank} {row.peer}"
                for key, row in list(differ.iterrows())[:limit]
            )
            lines.append(f"rank {peer.rank} disagrees with rank 0 on {len(differ)} gate row(s): {first} ({theirs_path})")
    return lines

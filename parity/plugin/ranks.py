"""Tensor-parallel sessions (`--parity-tp N`): one pytest session per rank, in lockstep, each a
process started by torch's launcher.

A sharded target computes with collectives, so every rank must run the same forwards in the same
order: every rank runs the same command line (same tests, same order: no xdist). The ranks are
started by torch's own launcher, never by parity: `torchrun --nnodes N --nproc-per-node G ...`
across machines, or, on one machine, `parity run --tp N` / `pytest --parity-tp N`, which start
their ranks through `torch.distributed.launcher` (`parity.plugin.launch`). A rank reads its place
from the environment the launcher sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
`MASTER_PORT`) and meets the others through the launcher's rendezvous (`env://`: gloo on CPU
tensors; NCCL on CUDA, one GPU per local rank, NVLink multicast off).

Rank 0 writes the run; rank r > 0 writes its own rows under `<run_dir>/ranks/rank-<r>/` (on its
own machine: nothing needs a shared disk). Every rank builds the single-process reference and
golden and judges the target's outputs, which are whole on every rank, so every rank computes the
same rows. At its end each rank hands rank 0, through the launcher's store, its exit status and
its gate verdicts; rank 0 records the run `complete` only when every rank finished its tests, and
fails it when a rank judged a gate row otherwise (`disagreements`).

A rank's health is its heartbeat (`parity.plugin.rank_health`): rank 0 names a rank whose
heartbeat is lost and a group in which no rank made progress for `PARITY_STALL_S`, stops every
rank and records the run's end; the collectives' own timeout (`PARITY_TP_TIMEOUT_S`, twice the
stall limit by default) is only the last resort. The factory of the target gets
`tp=TensorParallel(rank, world_size, group)` (docs/targets.md §11).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from parity.observe.progress import stall_limit
from parity.plugin.rank_health import heartbeat_lost_s

RANK_PID_ENV = "PARITY_TP_RANK_PID"  # the process that took the launcher's rank (its children are not ranks)
LOG_ENV = "PARITY_TP_LOG"  # where parity's launcher sends this rank's output (docs/lanes.md §5)
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_ENV = "PARITY_TP_TIMEOUT_S"
RANKS_DIR = "ranks"
# NVLink multicast must stay off on the lent GPU machines (NCCL NVLS, symmetric-memory multicast).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
EXIT_INTERRUPTED, EXIT_USAGE = 2, 4
POLL_S = 0.2

GROUP = pytest.StashKey["RankGroup"]()
ACTIVE: RankGroup | None = None  # this process's group while a tensor-parallel session runs
# Suites only rank 0 runs: the mutant catalogues' sessions start their own tensor-parallel groups.
RANK0_ONLY_SUITES = ("sensitivity", "target_mutants")
VERDICT_KEYS = ("suite", "case", "mode", "site", "metric")


# The signal the heartbeat thread interrupts this rank's main thread with: parity's own handler
# raises `GroupBroken` (a KeyboardInterrupt: pytest stops the session as for Ctrl-C), whatever
# a launcher or a shell did to SIGINT's handler (a background job's SIGINT is ignored).
BREAK_SIGNAL = signal.SIGUSR1


class GroupBroken(KeyboardInterrupt):
    """Raised in a rank's main thread when its tensor-parallel group is broken (a rank lost, a stall)."""


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """What a sharded target's factory receives: this process's rank, the group's size, the group."""

    rank: int
    world_size: int
    group: Any  # torch.distributed.ProcessGroup


def stall_s() -> float:
    """`PARITY_STALL_S` (parity.observe.progress), a bad value refused as a usage error."""
    try:
        return stall_limit()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def timeout_s() -> float:
    """Every collective's bound: `PARITY_TP_TIMEOUT_S`, else twice the stall limit (the heartbeat
    answers a hung rank first; this bound is the last resort for a rank that cannot answer)."""
    text = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(text) if text else 2 * stall_s()
    except ValueError:
        value = -1.0
    if not value > 0:
        raise pytest.UsageError(f"{TIMEOUT_ENV}={text!r}: expected seconds (a number > 0)")
    return value


def this_rank() -> int:
    """This process's rank in the tensor-parallel session it runs (0 outside one)."""
    return ACTIVE.rank if ACTIVE is not None else 0


@dataclasses.dataclass(frozen=True)
class LaunchedRank:
    """This process's place as torch's launcher (torchrun, `torch.distributed.launcher`) set it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    key: str  # the launch and restart this rank belongs to: the prefix of parity's keys in the store

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} (local rank {self.local_rank}, rendezvous {self.master_addr}:{self.master_port})"


def launched_rank(environ: Mapping[str, str] | None = None) -> LaunchedRank | None:
    """This process's rank when a launcher started it, else None. A process started by a rank (the
    sensitivity suite's sessions, a conformance check) inherits the rank's environment but is not
    that rank: the rank marks its own pid (`RANK_PID_ENV`) when it takes its place."""
    environ = os.environ if environ is None else environ
    if not all(environ.get(name) for name in LAUNCHER_ENV):
        return None
    owner = environ.get(RANK_PID_ENV)
    if owner and owner != str(os.getpid()):
        return None
    try:
        return LaunchedRank(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ["LOCAL_RANK"]),
            master_addr=environ["MASTER_ADDR"],
            master_port=int(environ["MASTER_PORT"]),
            key=f"parity-tp/{environ.get('TORCHELASTIC_RUN_ID', '')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
        )
    except ValueError:
        raise pytest.UsageError(
            "the launcher's environment is not numbers: "
            + ", ".join(f"{name}={environ.get(name)!r}" for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
        ) from None


def check_options(config: pytest.Config, world_size: int) -> None:
    """What a tensor-parallel session cannot be: a size below 1, xdist workers, an appended run."""
    if world_size < 1:
        raise pytest.UsageError(f"--parity-tp {world_size}: the tensor-parallel size must be at least 1")
    if world_size == 1:
        return
    numprocesses = config.getoption("numprocesses", None)
    if numprocesses not in (None, 0, "0"):
        raise pytest.UsageError(
            f"--parity-tp {world_size} with -n {numprocesses}: every rank must run the same tests in the same "
            "order, so a tensor-parallel session takes no xdist workers (leave -n out)"
        )
    if config.getoption("parity_append", False):
        raise pytest.UsageError(f"--parity-tp {world_size} with --parity-append: a tensor-parallel run is written whole")


@dataclasses.dataclass
class RankEnd:
    """Rank 0's account of the group at the session's end."""

    unfinished: list[str]  # one line per rank that did not finish its tests: the run is not complete
    disagreements: list[str]  # one line per rank that judged a gate row otherwise: the run fails
    peers: dict[int, dict[str, Any]]  # what each peer handed over (exit status, host, output)


class RankGroup:
    """This process's rank: the process group, the store, the heartbeat, the handshake at the end."""

    def __init__(self, launched: LaunchedRank, device: str) -> None:
        self.launched = launched
        self.rank = launched.rank
        self.world_size = launched.world_size
        self.device = device
        self.dead: str | None = None  # why the group broke (a lost rank, a stall, a failed collective)
        self.interrupted = False  # the heartbeat interrupted this process's main thread
        self.session: pytest.Session | None = None
        self.on_last_resort: Callable[[str], None] | None = None  # rank 0: records the run's end
        self._tp: TensorParallel | None = None
        self._store: Any = None
        self._heartbeat: Any = None
        self._ending = threading.Event()  # the main thread is in the end's handshake: do not interrupt it
        self._released = False
        self._stderr = -1  # this process's stderr as it was when the ranks met (pytest captures fd 2 in a test)
        self._previous_handler: Any = None

    # ---- meeting ----

    def meet(self) -> RankGroup:
        """Join the launcher's rendezvous, build the group the target computes in, start the heartbeat."""
        import torch
        import torch.distributed as dist

        from parity.plugin.rank_health import HealthJudge, Heartbeat

        if self.device == "cuda":
            for name, value in NCCL_ENV.items():
                os.environ.setdefault(name, value)
            torch.cuda.set_device(self.launched.local_rank)
        backend = "nccl" if self.device == "cuda" else "gloo"
        limit = timeout_s()
        try:
            if not dist.is_initialized():
                dist.init_process_group(
                    backend,
                    init_method="env://",
                    rank=self.rank,
                    world_size=self.world_size,
                    timeout=datetime.timedelta(seconds=limit),
                )
            # the group the target computes in: every collective bounded by the last-resort timeout
            group = dist.new_group(list(range(self.world_size)), timeout=datetime.timedelta(seconds=limit))
            self._store = self._client(limit)
            heartbeat_store = self._client(limit)
        except (RuntimeError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise pytest.UsageError(
                f"--parity-tp {self.world_size}: {self.launched.describe()} could not meet the other ranks "
                f"({type(exc).__name__}: {first})"
            ) from None
        self._tp = TensorParallel(self.rank, self.world_size, group)
        self._stderr = os.dup(2)
        self._previous_handler = signal.signal(BREAK_SIGNAL, self._raise_broken)
        stall, lost = stall_s(), heartbeat_lost_s(stall_s())
        judge = HealthJudge(range(self.world_size), stall, lost) if self.rank == 0 else HealthJudge([0], float("inf"), lost)
        self._heartbeat = Heartbeat(heartbeat_store, self.rank, judge, self._broken).start()
        return self

    def _client(self, limit: float) -> Any:
        """A connection of this process's own to the launcher's store, under parity's prefix."""
        import torch.distributed as dist

        store = dist.TCPStore(
            self.launched.master_addr,
            self.launched.master_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=limit),
            wait_for_workers=False,
        )
        return dist.PrefixStore(self.launched.key, store)

    def tensor_parallel(self) -> TensorParallel:
        """What the factory receives (the group was built when the ranks met)."""
        assert self._tp is not None, "the ranks have not met"
        return self._tp

    # ---- the run directory: rank 0 decides, the peers follow ----

    def publish_run_dir(self, run_dir: Path | None, refused: str = "") -> None:
        """Rank 0: tell the peers where the run is (or that it was refused before any test)."""
        self._store.set("run_dir", json.dumps({"run_dir": str(run_dir or ""), "refused": refused}))

    def peer_run_dir(self) -> Path:
        """A peer: its own run directory inside rank 0's, `<run_dir>/ranks/rank-<r>`; a peer whose
        rank 0 refused the session ends at once, without a word (rank 0 said it)."""
        self.moved("waiting for rank 0 to choose the run directory")
        while not self._store.check(["run_dir"]):
            if self.dead is not None:
                raise pytest.UsageError(f"--parity-tp {self.world_size}: rank {self.rank}: {self.dead}")
            time.sleep(POLL_S)
        said = json.loads(self._store.get("run_dir"))
        if said["refused"]:
            self._heartbeat.stop()
            os._exit(EXIT_USAGE)
        return Path(said["run_dir"]) / RANKS_DIR / f"rank-{self.rank}"

    # ---- progress and breakage ----

    def moved(self, where: str) -> None:
        if self._heartbeat is not None:
            self._heartbeat.moved(where)

    def _raise_broken(self, signum: int, frame: Any) -> None:
        raise GroupBroken(f"tensor-parallel group broken: {self.dead}")

    def _say(self, line: str) -> None:
        """One line on this rank's stderr as it was when the ranks met, past pytest's capture."""
        with contextlib.suppress(OSError):
            os.write(self._stderr if self._stderr >= 0 else 2, f"parity: rank {self.rank}: {line}\n".encode())

    def _broken(self, why: str) -> None:
        """From the heartbeat thread: the group is broken. Say so, stop the session after the test
        in flight, interrupt this process's main thread (a factory or a test that waits forever) unless
        it is already in the end's handshake, and as a last resort end the process."""
        if self.dead is None:
            self.dead = why
        self._say(f"tensor-parallel group broken: {why}")
        if self.session is not None:
            self.session.shouldstop = f"tensor-parallel group broken: {why}"
        if self._ending.is_set():
            return
        self.interrupted = True
        main = threading.main_thread()
        if main.ident is not None:
            signal.pthread_kill(main.ident, BREAK_SIGNAL)
        grace = heartbeat_lost_s(stall_s()) * (2 if self.rank == 0 else 1)
        threading.Thread(target=self._last_resort, args=(why, grace), name="parity-rank-last-resort", daemon=True).start()

    def _last_resort(self, why: str, grace: float) -> None:
        """A main thread that did not unwind within `grace` (stuck in a collective's C++ wait, or in
        code that never returns to Python): record the end (rank 0) and end the process."""
        if self._ending.wait(grace):
            return
        if self.on_last_resort is not None:
            with contextlib.suppress(Exception):  # nothing more can be done here: the line above said why
                self.on_last_resort(why)
        self._say(f"did not stop within {grace:.0f} s after the group broke: ending it")
        os._exit(EXIT_INTERRUPTED)

    def collective_failed(self, session: pytest.Session, nodeid: str, exc: BaseException, tb: Any) -> None:
        """Any rank: a test whose collective failed (lost a dead rank, timed out) leaves the group
        unusable, so the session stops after it instead of failing test by test."""
        if not raised_by_a_collective(exc, tb):
            return
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        why = f"a collective failed in {nodeid} on rank {self.rank} ({first})"
        self.dead = self.dead or why
        session.shouldstop = f"tensor-parallel group broken: {why}"

    # ---- the end ----

    def _destroy(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def finish_peer(self, exitstatus: int, reason: str, results: Path) -> bool:
        """A peer: hand rank 0 this rank's end (exit status, why it stopped, its gate verdicts),
        leave the group, and wait until rank 0 has recorded the run, or until rank 0's heartbeat
        is lost. True when rank 0 took the hand-over."""
        from parity.plugin.rank_health import HealthJudge, Position

        self._ending.set()
        self._heartbeat.finished()
        status = {
            "exitstatus": int(exitstatus),
            "reason": reason,
            "host": socket.gethostname(),
            "log": os.environ.get(LOG_ENV, ""),
            "run_dir": str(results),
            "verdicts": gate_verdicts(results),
        }
        try:
            self._store.set(f"status/{self.rank}", json.dumps(status))
        except Exception as exc:  # the store is gone with rank 0
            self.release()
            self.dead = self.dead or f"could not hand over this rank's end ({type(exc).__name__})"
            return False
        self._destroy()  # frees rank 0 if it still waits in a collective with this rank
        rank0 = HealthJudge([0], float("inf"), heartbeat_lost_s(stall_s()))
        acknowledged = False
        try:
            while True:
                try:
                    if self._store.check(["done"]):
                        acknowledged = True
                        self._store.set(f"bye/{self.rank}", "1")
                        break
                    beat = self._store.get("beat/0").decode() if self._store.check(["beat/0"]) else None
                except Exception:  # the store is gone: rank 0 or its launcher ended
                    break
                rank0.observe({0: Position.decode(beat) if beat else None})
                if rank0.verdict() is not None:
                    self.dead = self.dead or rank0.verdict()
                    break
                time.sleep(POLL_S)
        except KeyboardInterrupt:  # the launcher stops this rank: its end is said, rank 0 may be gone
            pass
        self.release()
        return acknowledged

    def finish_rank0(self, results: Path, *, signalled: bool, refused: bool = False) -> RankEnd:
        """Rank 0: wait until every peer has handed over its end or its heartbeat is lost (a peer
        the group's stall interrupted hands over too, or its last resort ends it), and account for
        the group. A rank 0 stopped by a signal (its launcher stopping every rank) does not wait; a
        rank 0 that refused the session (`refused`: a usage error) expects its peers to have too."""
        self._ending.set()
        self._heartbeat.finished()
        if self.dead is not None or signalled:
            self._destroy()  # a peer may wait in a collective this rank never joined
        waiting = set(range(1, self.world_size)) if not signalled else set()
        try:
            peers, lost = self._collect_ends(waiting)
        except KeyboardInterrupt:  # the launcher stops every rank (one exited): account for what came
            peers, lost, signalled = {}, {}, True
            for rank in waiting:
                with contextlib.suppress(Exception):
                    if self._store.check([f"status/{rank}"]):
                        peers[rank] = json.loads(self._store.get(f"status/{rank}"))
        self._destroy()
        unfinished = []
        for rank in range(1, self.world_size):
            if rank not in peers:
                why = lost.get(rank) or ("this rank was stopped by a signal first" if signalled else "no word from it")
                if self.dead and self.dead not in why:
                    why = f"{why}; the group broke first: {self.dead}"
                unfinished.append(f"rank {rank} did not finish its tests: {why}")
                continue
            status = peers[rank]
            if status["exitstatus"] not in (0, 1, 5) and not (refused and status["exitstatus"] == EXIT_USAGE):
                said = f": {status['reason']}" if status.get("reason") else ""
                unfinished.append(f"rank {rank} ended with status {status['exitstatus']}{said} ({output_of(rank, status)})")
        disagreements = [] if unfinished else disagreements_with(results, peers)
        return RankEnd(unfinished, disagreements, peers)

    def _collect_ends(self, waiting: set[int]) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
        """Rank 0: each peer's end as it hands it over, until none is missing or the heartbeat of
        one that is missing is lost (then why, for every rank still missing)."""
        from parity.plugin.rank_health import HealthJudge, Position

        peers: dict[int, dict[str, Any]] = {}
        waiting = set(waiting)
        alive = HealthJudge(waiting, float("inf"), heartbeat_lost_s(stall_s()))
        while waiting:
            try:
                for rank in sorted(waiting):
                    if self._store.check([f"status/{rank}"]):
                        peers[rank] = json.loads(self._store.get(f"status/{rank}"))
                        waiting.discard(rank)
                beats = {r: self._store.get(f"beat/{r}").decode() for r in waiting if self._store.check([f"beat/{r}"])}
            except Exception as exc:  # the launcher's store is gone: no peer can hand anything over
                return peers, dict.fromkeys(waiting, f"the launcher's store is gone ({type(exc).__name__})")
            alive.observe({rank: Position.decode(text) for rank, text in beats.items()})
            alive.seen = {rank: seen for rank, seen in alive.seen.items() if rank in waiting}
            why = alive.verdict()
            if why is not None:
                return peers, dict.fromkeys(waiting, why)
            if waiting:
                time.sleep(POLL_S)
        return peers, {}

    def _wait_for_goodbyes(self) -> None:
        """Rank 0: let the peers that handed over their end exit first (a launcher stops every rank
        once one has exited with a failure, rank 0's own verdict included), for at most the time a
        heartbeat may be missed."""
        deadline = time.monotonic() + heartbeat_lost_s(stall_s())
        waiting = {rank for rank in range(1, self.world_size) if self._store.check([f"status/{rank}"])}
        with contextlib.suppress(KeyboardInterrupt):  # a launcher stopping the ranks: nothing left to wait for
            while waiting and time.monotonic() < deadline:
                waiting = {rank for rank in waiting if not self._store.check([f"bye/{rank}"])}
                time.sleep(POLL_S)

    def release(self) -> None:
        """Rank 0, once the run's end is recorded: the peers may exit. Every rank: stop the heartbeat."""
        global ACTIVE
        if self._released:
            return
        self._released = True
        self._ending.set()
        if self.rank == 0 and self._store is not None:
            with contextlib.suppress(Exception):  # the peers find the store gone and exit too
                self._store.set("done", "1")
                self._wait_for_goodbyes()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(BREAK_SIGNAL, self._previous_handler)
        if ACTIVE is self:
            ACTIVE = None


def output_of(rank: int, status: Mapping[str, Any]) -> str:
    """Where a rank's output went, for a line naming it."""
    if status.get("log"):
        return f"its output: {status.get('host', '?')}:{status['log']}"
    return f"its output: the launcher's output of rank {rank} on {status.get('host', '?')}"


# What a failed gloo or NCCL collective raises: a RuntimeError (DistBackendError on recent torch)
# with the backend's own words, "Timed out waiting ...ms for recv" or "Connection closed by peer".
_BACKEND_WORDS = ("gloo", "nccl", "connection closed by peer", "timed out waiting")


def raised_by_a_collective(exc: BaseException, tb: Any) -> bool:
    """Whether `exc` came out of torch.distributed (a collective or its wait), not the test's own check."""
    import traceback

    distributed = any("torch/distributed/" in frame.filename.replace("\\", "/") for frame in traceback.extract_tb(tb))
    text = str(exc).lower()
    return distributed or (isinstance(exc, RuntimeError) and any(word in text for word in _BACKEND_WORDS))


def configure(config: pytest.Config, world_size: int, device: str) -> RankGroup | None:
    """This session's rank (None for a single-process run), met and stashed on the config. A
    tensor-parallel session must have been started by a launcher; a session a launcher started as
    one of several ranks must be a tensor-parallel one of that size."""
    global ACTIVE
    check_options(config, world_size)
    launched = launched_rank()
    if launched is not None and launched.world_size > 1 and world_size != launched.world_size:
        raise pytest.UsageError(
            f"--parity-tp {world_size}: this process is {launched.describe()} (RANK, WORLD_SIZE set by torchrun or another "
            f"launcher): give --parity-tp {launched.world_size} (--tp {launched.world_size} to parity run), the launcher's "
            "world size (nodes x processes per node)"
        )
    if world_size == 1:
        return None
    if launched is None:
        raise pytest.UsageError(
            f"--parity-tp {world_size}: this process was not started as a rank (no RANK, WORLD_SIZE, MASTER_ADDR from "
            "torchrun): run `parity run --tp N`, `pytest --parity-tp N` (both start the ranks) or "
            f"`torchrun --nproc-per-node {world_size} -m pytest ... --parity-tp {world_size}`"
        )
    if device == "cuda":
        import torch

        if torch.cuda.device_count() <= launched.local_rank:
            raise pytest.UsageError(
                f"--parity-tp {world_size} on cuda: local rank {launched.local_rank} needs GPU {launched.local_rank}, "
                f"{torch.cuda.device_count()} visible"
            )
    os.environ[RANK_PID_ENV] = str(os.getpid())  # this process is the rank; its children are not
    group = RankGroup(launched, device).meet()
    config.stash[GROUP] = group
    ACTIVE = group
    return group


def gate_verdicts(results: Path) -> list[list[str]]:
    """The gate rows' keys and verdicts of a rank's run (rank-0-only suites left out), as the
    peer hands them to rank 0: [suite, case, mode, site, metric, verdict] per row."""
    from parity.report import RESULTS_FILE, ReportError, read_results

    if not (results / RESULTS_FILE).is_file():
        return []
    try:
        rows = read_results(results)
    except (OSError, ReportError):
        return []
    gates = rows[(rows["kind"] == "gate") & ~rows["suite"].isin(RANK0_ONLY_SUITES)]
    return gates[[*VERDICT_KEYS, "verdict"]].astype(str).to_numpy().tolist()


def disagreements_with(run_dir: Path, peers: Mapping[int, Mapping[str, Any]], limit: int = 5) -> list[str]:
    """Rank 0: where a peer's gate verdicts differ from rank 0's (every rank judges whole outputs,
    so a difference means the ranks computed different things: a rank-dependent input or a
    collective that is not one). One line per disagreeing rank, naming its first rows."""
    import pandas as pd

    def indexed(records: list[list[str]]) -> Any:
        frame = pd.DataFrame(records, columns=[*VERDICT_KEYS, "verdict"])
        frame["_n"] = frame.groupby(list(VERDICT_KEYS), sort=False).cumcount()
        return frame.set_index([*VERDICT_KEYS, "_n"])["verdict"]

    mine = indexed(gate_verdicts(run_dir))
    lines = []
    for rank, status in sorted(peers.items()):
        theirs = indexed(status.get("verdicts", []))
        both = mine.to_frame("rank0").join(theirs.to_frame("peer"), how="outer")
        differ = both[both["rank0"].fillna("(none)") != both["peer"].fillna("(none)")]
        if len(differ):
            first = "; ".join(
                f"{'/'.join(str(k) for k in key[:3] if k and k != 'nan')} {key[4]}: rank 0 {row.rank0}, rank {rank} {row.peer}"
                for key, row in list(differ.iterrows())[:limit]
            )
            where = f"{status.get('host', '?')}:{status.get('run_dir', '?')}"
            lines.append(f"rank {rank} disagrees with rank 0 on {len(differ)} gate row(s): {first} ({where})")
    return lines

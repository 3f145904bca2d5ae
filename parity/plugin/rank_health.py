"""A tensor-parallel rank's health: a heartbeat and a position, judged by progress, not by a clock.

Every rank publishes, about once a second, in the store of its launcher (torchrun's rendezvous
store, or the one `parity run --tp` starts): a beat counter (its process is alive and not frozen),
a progress counter and where it is (`calling the target's factory`, a test and its phase,
`finished its tests`). A collective's timeout cannot tell a slow healthy rank from a hung one; the
positions can (docs/lanes.md §5):

- a rank whose beat has not moved for `heartbeat_lost_s` has ended or is frozen;
- a group in which no rank has made progress for the stall limit (`PARITY_STALL_S`) while some
  rank has not finished is stalled, and the line names every rank's position (the one that is
  behind, in a factory or a test the others have left, is the culprit).

`HealthJudge` is that rule on its own (a clock is passed in, so it is tested without waiting);
`Heartbeat` is the thread that publishes and, on rank 0, judges.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

BEAT_INTERVAL_S = 1.0
# A live process's heartbeat thread beats about once a second; one that has not beaten for this long
# (or for the stall limit, if that is shorter) has ended or is frozen.
HEARTBEAT_LOST_S = 120.0
RUNNING, FINISHED = "running", "finished"


@dataclasses.dataclass(frozen=True)
class Position:
    """What a rank last published: its beat and progress counters, its state and where it is."""

    beats: int
    progress: int
    state: str
    where: str

    def encode(self) -> str:
        return f"{self.beats}|{self.progress}|{self.state}|{self.where}"

    @classmethod
    def decode(cls, text: str) -> Position:
        beats, progress, state, where = text.split("|", 3)
        return cls(int(beats), int(progress), state, where)


@dataclasses.dataclass
class _Seen:
    position: Position | None = None
    beat_at: float = 0.0  # when its beat counter last moved (this process's clock)


def heartbeat_lost_s(stall_s: float) -> float:
    """Seconds without a heartbeat after which a rank counts as ended or frozen."""
    return min(stall_s, HEARTBEAT_LOST_S)


class HealthJudge:
    """Rank 0's view of every rank: whose heartbeat is lost, and whether the group has stalled."""

    def __init__(self, ranks: Iterable[int], stall_s: float, lost_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """`ranks`: the ranks watched (rank 0 watches all; a peer only rank 0, with no stall limit)."""
        self.stall_s = stall_s
        self.lost_s = lost_s
        self.clock = clock
        start = clock()
        self.seen = {rank: _Seen(None, start) for rank in ranks}
        self.progress_at = start  # when any rank's progress counter last moved

    def observe(self, positions: dict[int, Position | None]) -> None:
        now = self.clock()
        for rank, position in positions.items():
            seen = self.seen.get(rank)
            if seen is None or position is None:
                continue
            if seen.position is None or position.beats != seen.position.beats:
                seen.beat_at = now
            if seen.position is None or position.progress != seen.position.progress or position.state != seen.position.state:
                self.progress_at = now
            seen.position = position

    def where(self, rank: int) -> str:
        position = self.seen[rank].position
        if position is None:
            return "not started (no heartbeat yet)"
        return "finished its tests" if position.state == FINISHED else position.where

    def verdict(self) -> str | None:
        """One line saying why the group is broken, or None while it is healthy."""
        now = self.clock()
        for rank, seen in self.seen.items():
            if now - seen.beat_at >= self.lost_s:
                what = "sent no heartbeat" if seen.position is not None else "never sent a heartbeat"
                return f"rank {rank} {what} for {self.lost_s:.0f} s: its process ended or is frozen (last at: {self.where(rank)})"
        everyone_done = all(seen.position is not None and seen.position.state == FINISHED for seen in self.seen.values())
        if not everyone_done and now - self.progress_at >= self.stall_s:
            places = "; ".join(f"rank {rank} at {self.where(rank)}" for rank in self.seen)
            return f"no rank made progress for {self.stall_s:.0f} s ({places})"
        return None


class Heartbeat:
    """The thread that publishes this rank's position and watches the group (rank 0 judges every
    rank; a peer watches rank 0's heartbeat and the abort key). `store`: a `torch.distributed`
    store for this thread alone; `broken(why)` is called once, from this thread, when the group is
    broken (here or on another rank); the thread goes on beating until `stop`, so the others can
    tell this rank is still there while it ends."""

    ABORT = "abort"

    def __init__(self, store: Any, rank: int, judge: HealthJudge, broken: Callable[[str], None]) -> None:
        self.store = store
        self.rank = rank
        self.judge = judge
        self.broken = broken
        self.beats = 0
        self.progress = 0
        self.state = RUNNING
        self.where = "starting"
        self.verdict: str | None = None  # why this thread found the group broken (said once)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"parity-rank-{rank}-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._publish()
        self._thread.start()
        return self

    def moved(self, where: str) -> None:
        """The main thread made progress and is now at `where`."""
        self.progress += 1
        self.where = where.replace("|", "/")

    def finished(self) -> None:
        self.state = FINISHED
        self.moved("finished its tests")

    def stop(self) -> None:
        self._stop.set()

    def broken_by_judge(self) -> bool:
        """Whether this thread has found the group broken (a lost heartbeat, a stall, an abort)."""
        return self.verdict is not None

    def abort(self, why: str) -> None:
        """Tell every rank the group is broken."""
        with contextlib.suppress(Exception):  # the store is gone: each rank finds out by itself
            self.store.set(self.ABORT, why)

    def _publish(self) -> None:
        self.beats += 1
        self.store.set(f"beat/{self.rank}", Position(self.beats, self.progress, self.state, self.where).encode())

    def _positions(self) -> dict[int, Position | None]:
        found: dict[int, Position | None] = {}
        for rank in self.judge.seen:
            key = f"beat/{rank}"
            found[rank] = Position.decode(self.store.get(key).decode()) if self.store.check([key]) else None
        return found

    def _judge(self) -> str | None:
        """Why the group is broken, by the abort key or this rank's judge; None while it is not."""
        if self.store.check([self.ABORT]):
            return self.store.get(self.ABORT).decode()
        self.judge.observe(self._positions())  # a peer's judge watches rank 0 only: rank 0 judges the group
        why = self.judge.verdict()
        if why is not None:
            self.abort(why)
        return why

    def _run(self) -> None:
        while not self._stop.wait(BEAT_INTERVAL_S):
            try:
                self._publish()
                why = self._judge() if self.verdict is None else None
            except Exception as exc:  # the store went away with its host (rank 0 or the launcher)
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                why = f"the launcher's store is gone ({first}): rank 0 or its launcher ended"
                self._stop.set()
            if why is not None and self.verdict is None:
                self.verdict = why
                self.broken(why)

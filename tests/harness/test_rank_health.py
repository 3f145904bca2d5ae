"""A tensor-parallel rank's health (`parity.plugin.rank_health.HealthJudge`), on a simulated clock:
a slow group that keeps moving is never stopped, a frozen one is, named rank by rank, and a rank
whose heartbeat stops is named even while the others move. No test here waits for anything."""

from __future__ import annotations

import pytest

from parity.plugin.rank_health import FINISHED, RUNNING, HealthJudge, Position

pytestmark = [pytest.mark.parity_cpu]

STALL_S, LOST_S = 20.0, 20.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Group:
    """Two ranks publishing positions to a judge on a clock this test moves."""

    def __init__(self, judge_type: type[HealthJudge] = HealthJudge) -> None:
        self.clock = Clock()
        self.judge = judge_type(range(2), STALL_S, LOST_S, clock=self.clock)
        self.beats = [0, 0]
        self.progress = [0, 0]
        self.where = ["starting", "starting"]
        self.state = [RUNNING, RUNNING]

    def tick(self, seconds: float, *, beating: tuple[int, ...] = (0, 1)) -> str | None:
        """`seconds` pass with a beat a second from the ranks in `beating`; the judge's verdict."""
        for _ in range(int(seconds)):
            self.clock.now += 1.0
            for rank in beating:
                self.beats[rank] += 1
            self.judge.observe({r: Position(self.beats[r], self.progress[r], self.state[r], self.where[r]) for r in range(2)})
            verdict = self.judge.verdict()
            if verdict is not None:
                return verdict
        return None

    def move(self, rank: int, where: str) -> None:
        self.progress[rank] += 1
        self.where[rank] = where


def test_a_slow_group_that_keeps_moving_is_never_stopped() -> None:
    """Each rank moves on only every 19 s (a long compile on a loaded machine), for 20 stall limits."""
    group = Group()
    for step in range(20):
        assert group.tick(19) is None, step
        group.move(step % 2, f"test {step} (call)")


def test_a_frozen_group_is_named_rank_by_rank() -> None:
    group = Group()
    group.move(0, "parity/suites/ar/test_numerics.py::t[eager] (call)")
    group.move(1, "calling the target's factory (variants:hangs)")
    verdict = group.tick(60)
    assert verdict == (
        "no rank made progress for 20 s (rank 0 at parity/suites/ar/test_numerics.py::t[eager] (call); "
        "rank 1 at calling the target's factory (variants:hangs))"
    )
    # named as soon as the limit is reached on the simulated clock (positions first seen at 1 s), not later
    assert group.clock.now == 1 + STALL_S


def test_one_rank_moving_keeps_the_group_alive() -> None:
    """Rank 0 runs tests only it runs (the mutant catalogue) while rank 1 waits: progress, no stall."""
    group = Group()
    group.move(1, "finished its tests")
    group.state[1] = FINISHED
    for step in range(10):
        group.move(0, f"sensitivity test {step}")
        assert group.tick(15) is None


def test_a_rank_whose_heartbeat_stops_is_named_while_the_others_move() -> None:
    group = Group()
    group.move(1, "parity/suites/ar/test_decode.py::t (call)")
    for step in range(5):
        group.move(0, f"test {step}")
        verdict = group.tick(5, beating=(0,))
        if verdict:
            break
    assert verdict == (
        "rank 1 sent no heartbeat for 20 s: its process ended or is frozen (last at: parity/suites/ar/test_decode.py::t (call))"
    )


def test_a_finished_group_is_not_stalled() -> None:
    group = Group()
    group.state = [FINISHED, FINISHED]
    group.move(0, "finished its tests")
    group.move(1, "finished its tests")
    assert group.tick(100) is None


class _TotalTimeJudge(HealthJudge):
    """The broken variant: a guard that counts total time (a collective's timeout), not progress."""

    def verdict(self) -> str | None:
        return f"no answer within {self.stall_s:.0f} s" if self.clock() >= self.stall_s else None


def test_a_total_time_guard_would_stop_the_slow_healthy_group() -> None:
    """What the heartbeat replaces: a total-time bound ends the slow group of the first test above."""
    group = Group(_TotalTimeJudge)
    verdicts = []
    for step in range(20):
        verdicts.append(group.tick(19))
        group.move(step % 2, f"test {step} (call)")
    assert any(verdicts), verdicts


def test_a_position_survives_its_encoding() -> None:
    position = Position(12, 3, RUNNING, "parity/suites/ar/test_numerics.py::t[eager-und/only] (call)")
    assert Position.decode(position.encode()) == position

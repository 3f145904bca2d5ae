"""Sharded targets whose second rank fails, as `--parity-target` factories of a `--parity-tp 2` run."""

from __future__ import annotations

import os
import time
from typing import Any


def _serving(tp: Any) -> Any:
    from serving_models.target import make_target

    return make_target(tp=tp)


def make_target_rank1_dies(tp: Any = None) -> Any:
    """Rank 1 exits with status 7 once the group has met: rank 0's first collective loses its peer."""
    if tp is not None and tp.rank == 1:
        os._exit(7)
    return _serving(tp)


def make_target_rank1_hangs(tp: Any = None) -> Any:
    """Rank 1 never returns from its factory: rank 0's first collective waits for it until the timeout."""
    if tp is not None and tp.rank == 1:
        time.sleep(3600)
    return _serving(tp)


def make_target_without_tp() -> Any:
    """A single-process factory: a tensor-parallel run must refuse it before any test."""
    return _serving(None)


HANG_ENV = "PARITY_TEST_HANG_S"  # how long a "hanging" factory sleeps (a broken variant's run must end by itself)


def make_target_rank0_hangs(tp: Any = None) -> Any:
    """Rank 0 does not return from its factory (for `PARITY_TEST_HANG_S`, an hour by default): rank
    1 waits for it in its first collective."""
    if tp is not None and tp.rank == 0:
        time.sleep(float(os.environ.get(HANG_ENV, "3600")))
    return _serving(tp)

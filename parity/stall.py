"""How long parity waits for a sign of progress before it calls a process stalled.

A hang guard that counts total wall-clock time turns a slow, healthy process on a busy machine
into a failure; a guard that waits for *progress* (a test phase ending, a heartbeat) does not. Every
stall guard of a run reads one setting, `PARITY_STALL_S` (seconds without progress, 1800 by
default: a compile of the full-size model on a loaded machine is minutes, not half an hour), so
a user who needs more patience sets it once (docs/cli.md §1).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

STALL_ENV = "PARITY_STALL_S"
DEFAULT_STALL_S = 1800.0
# A live process's heartbeat thread beats about once a second; one that has not beaten for this long
# (or for the stall limit, if that is shorter) has ended or is frozen (docs/lanes.md §4).
HEARTBEAT_LOST_S = 120.0


def stall_limit_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds without progress after which a guard calls a process stalled: `PARITY_STALL_S`,
    else 1800. A value that is not a number > 0 is a ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    text = environ.get(STALL_ENV, "").strip()
    if not text:
        return DEFAULT_STALL_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{STALL_ENV}={text!r}: expected seconds without progress (a number > 0)")
    return value


def heartbeat_lost_s(stall_s: float) -> float:
    """Seconds without a heartbeat after which a process counts as ended or frozen."""
    return min(stall_s, HEARTBEAT_LOST_S)

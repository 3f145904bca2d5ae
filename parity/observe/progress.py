"""Hang guards that judge progress, never the clock (docs/lanes.md §4).

A guard that counts total wall-clock time turns a slow, healthy process on a busy machine into a
failure; a guard that waits for *progress* does not. Every stall guard reads one setting,
`PARITY_STALL_S`: the seconds a process may go without progress before it is called stalled
(900 by default: the longest silent stretch of a healthy process is an Inductor compile, minutes
on a loaded machine). The tensor-parallel ranks' heartbeat (`parity.plugin.rank_health`) uses it.
"""

from __future__ import annotations

import os

STALL_ENV = "PARITY_STALL_S"
DEFAULT_STALL_S = 900.0


def stall_limit(given: float | None = None) -> float:
    """Seconds without progress after which a process is stalled: `given`, else $PARITY_STALL_S,
    else 900. Not a finite number > 0: a ValueError naming the variable."""
    if given is None:
        text = os.environ.get(STALL_ENV, "").strip()
        if not text:
            return DEFAULT_STALL_S
        try:
            given = float(text)
        except ValueError:
            raise ValueError(f"{STALL_ENV}={text!r}: expected a number of seconds") from None
    if not given > 0 or given == float("inf"):
        raise ValueError(f"{STALL_ENV} {given!r}: expected a finite number of seconds > 0")
    return float(given)

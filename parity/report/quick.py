"""A quick run's rows (`parity run --quick`, docs/cli.md §11) and what a review compares them with.

A quick run keeps the smallest cases of each suite, in eager and the graph stand-in, and compiles
without code generation; its rows carry `size` `<size>-quick` (`tiny-quick`) and its run.json
`quick: true`. The size is part of a run's configuration, so the audit refuses a run whose rows
mix the two and a comparison refuses a baseline of the other kind, like one of another dtype. The
default baseline of a quick run is a quick one (`<device kind>-<dtype>-quick.csv`): a full lane's
baseline would read every case and mode the quick lane leaves out as vanished.
"""

from __future__ import annotations

import pandas as pd

QUICK_SUFFIX = "-quick"


def quick_size(size: str) -> str:
    """The `size` a quick run's rows carry."""
    return f"{size}{QUICK_SUFFIX}"


def is_quick(size: object) -> bool:
    return str(size).endswith(QUICK_SUFFIX)


def baseline_suffix(size: object) -> str:
    """What a quick run's default baseline file name adds (`cpu-fp32-quick.csv`); '' for a full run."""
    return QUICK_SUFFIX if is_quick(size) else ""


def mismatch_note(baseline_size: object, run_size: object) -> str:
    """Why a quick run and a full baseline (or the other way round) are not compared ('' when they may be)."""
    if is_quick(baseline_size) == is_quick(run_size):
        return ""
    quick, full = ("this run", "the baseline") if is_quick(run_size) else ("the baseline", "this run")
    return (
        f"{quick} is a quick run (parity run --quick: a subset of the cases and modes, compiled without code generation) "
        f"and {full} is not: a quick run is compared only with a quick run or baseline"
    )


def quick_note(frame: pd.DataFrame) -> str:
    """What a review adds where a quick run finds no quick baseline ('' for a full run)."""
    if frame.empty or not is_quick(frame["size"].iloc[0]):
        return ""
    return " (a quick run: compared only with a quick baseline, never with the full lane's; write one with --write-baseline)"

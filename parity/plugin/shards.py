"""`--parity-shard K/N`: the K-th of N deterministic, cost-balanced parts of a session's selection,
so a CI matrix runs a long lane on N machines and `parity merge` makes one run of the parts.

Every shard collects the same tests (same tree, same options but the shard) and cuts the same plan
from them, with no coordination: the selection is split into units, each unit goes whole to one
shard, and the units are dealt out costliest first to the shard with the least cost so far (ties to
the lower index). A unit is what must not be split (docs/lanes.md §5):

- a model family's tests that share compiled code (`parity_keep_compile_cache`: a test starting
  from an empty Dynamo cache between them would recompile, and a compile that sees other shapes
  first may pick other kernels);
- otherwise one case of one family: its tests in every mode judge against the same golden forward,
  computed once per session (`parity.suites.ar.support.ARModels`).

A unit's cost is its tests' measured seconds (`MEASURED_COST_S`, the CPU lane); the mutant
catalogue's sessions (the sensitivity suite, rank 0 only in a tensor-parallel run) are dealt after
the others, so every rank of a sharded tensor-parallel run cuts the same plan from the tests it
shares. The shard records what it is in run.json (`shard`): its index and count, the selection's
digest and size, its own tests' count, and the tree it ran (`parity.env.tree_digest`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from parity.plugin.lanes import KEEP_COMPILE_CACHE, suite_of

SHARD = pytest.StashKey["ShardPlan"]()
# Seconds a test takes, by its module (without `test_`) and mode ('-': a test without one), measured
# in a CPU-lane run with --durations on the 2-core machine under load (docs/performance.md); only the
# ratios matter. A test not listed costs DEFAULT_COST_S. The mutant catalogue's tests wait for their
# isolated sessions, which run beside the other tests: their seconds are those sessions' work.
MEASURED_COST_S = {
    ("expert_selection", "compiled"): 16.5,
    ("expert_selection", "cpu_graph"): 5.4,
    ("embedding_clamp", "compiled"): 38.6,
    ("embedding_clamp", "eager"): 2.1,
    ("decode", "cpu_graph"): 8.2,
    ("decode", "eager"): 1.2,
    ("numerics", "cpu_graph"): 3.7,
    ("numerics", "-"): 0.8,
    ("fail_closed_capture", "-"): 5.5,
    ("fail_closed_capture", "cpu_graph"): 4.6,
    ("image", "-"): 3.0,
    ("recompiles", "-"): 51.3,
    ("ranks", "-"): 21.4,
    ("weight_coverage", "-"): 1.5,
    ("sensitivity", "-"): 12.7,
}
DEFAULT_COST_S = 0.2
LAST_SUITES = ("sensitivity",)  # dealt after every other unit (rank 0 alone runs them at --tp N)
_SHARD = re.compile(r"(\d+)/(\d+)")


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int  # 1-based
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str, option: str = "--shard") -> Shard:
    """`K/N` with 1 <= K <= N, else a ValueError naming the option."""
    match = _SHARD.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{option} {text!r}: expected K/N, this shard's number and the number of shards (e.g. 1/2)")
    index, count = int(match.group(1)), int(match.group(2))
    if not 1 <= index <= count:
        raise ValueError(f"{option} {text}: the shard's number must be between 1 and {count}")
    return Shard(index, count)


def _family(item: pytest.Item) -> str:
    parts = Path(str(item.path)).parts
    if "suites" in parts:
        at = len(parts) - 1 - parts[::-1].index("suites")
        return parts[at + 1] if at + 1 < len(parts) - 1 else parts[-1]
    return str(item.path)


def _param_key(value: Any) -> str:
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return name
    if value is None or isinstance(value, (str, int, float, bool)):
        return repr(value)
    return type(value).__name__  # an unnamed object: its tests stay together with others of its type


def unit_of(item: pytest.Item) -> tuple[str, ...]:
    """What `item` must share a shard with (see the module docstring)."""
    family = _family(item)
    if item.get_closest_marker(KEEP_COMPILE_CACHE) is not None:
        return (family, "shared compiled code")
    params = getattr(getattr(item, "callspec", None), "params", {})
    case = tuple(f"{name}={_param_key(value)}" for name, value in sorted(params.items()) if name != "mode")
    if not case:
        return (family, item.nodeid)
    return (family, *case)


def item_cost(item: pytest.Item) -> float:
    """What `item` is expected to take (`MEASURED_COST_S`)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    mode = params.get("mode")
    mode = mode if isinstance(mode, str) else "-"
    module = Path(str(item.path)).stem.removeprefix("test_")
    return MEASURED_COST_S.get((module, mode), DEFAULT_COST_S)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """This shard's part of the selection, and what identifies the selection it is a part of."""

    shard: Shard
    selection: str  # digest of the selection's node ids, in collection order
    selection_tests: int
    tests: int
    cost: float
    costs: tuple[float, ...]  # every shard's cost, for the record

    def record(self) -> dict[str, Any]:
        from parity.env import tree_digest

        return {
            "index": self.shard.index,
            "count": self.shard.count,
            "selection": self.selection,
            "selection_tests": self.selection_tests,
            "tests": self.tests,
            "cost": round(self.cost, 1),
            "costs": [round(c, 1) for c in self.costs],
            "tree": tree_digest(),
        }


def assign(items: Sequence[pytest.Item], count: int) -> list[int]:
    """The shard (0-based) of each item: units dealt costliest first to the least-loaded shard; the
    units of `LAST_SUITES` after all others."""
    units: dict[tuple[str, ...], list[int]] = {}
    for index, item in enumerate(items):
        units.setdefault(unit_of(item), []).append(index)
    load = [0.0] * count
    shard_of = [0] * len(items)

    def deal(keys: list[tuple[str, ...]]) -> None:
        # fsum: exact, so a unit's cost is the same whatever order the tests were collected in
        costs = {key: math.fsum(item_cost(items[i]) for i in units[key]) for key in keys}
        for key in sorted(keys, key=lambda k: (-costs[k], k)):
            target = min(range(count), key=lambda s: (load[s], s))
            load[target] += costs[key]
            for i in units[key]:
                shard_of[i] = target

    last = [key for key in units if suite_of(items[units[key][0]]) in LAST_SUITES]
    deal([key for key in units if key not in last])
    deal(last)
    return shard_of


def plan(items: Sequence[pytest.Item], shard: Shard) -> tuple[ShardPlan, list[pytest.Item], list[pytest.Item]]:
    """This shard's plan, its items (collection order kept) and the others."""
    digest = hashlib.sha256("\n".join(item.nodeid for item in items).encode()).hexdigest()[:16]
    shard_of = assign(items, shard.count)
    costs = [0.0] * shard.count
    for item, s in zip(items, shard_of):
        costs[s] += item_cost(item)
    keep = [item for item, s in zip(items, shard_of) if s == shard.index - 1]
    drop = [item for item, s in zip(items, shard_of) if s != shard.index - 1]
    found = ShardPlan(shard, digest, len(items), len(keep), costs[shard.index - 1], tuple(costs))
    return found, keep, drop

"""`--shard K/N` and `parity merge`: the plan that cuts a selection into parts (deterministic,
cost-balanced, shared compiles and cases whole), and the CPU lane in two shards, merged, reviewed
against the one-machine lane run: the same gate rows and verdicts (docs/lanes.md §5)."""

from __future__ import annotations

import collections
import dataclasses
import random
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from parity.plugin import shards
from parity.plugin.lanes import KEEP_COMPILE_CACHE, SUITE
from parity.report import read_results, read_run_info
from tests.support.helpers import run_parity
from tests.support.shared_run import SharedRun

pytestmark = [pytest.mark.parity_cpu]

# ---------------------------------------------------------------------------------------------
# The plan, on stand-ins for collected tests
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Marker:
    args: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _Callspec:
    params: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class _Item:
    """What the plan reads of a collected test: its path, node id, parameters and markers."""

    path: Path
    nodeid: str
    callspec: _Callspec
    markers: tuple[str, ...]
    suite: str

    def get_closest_marker(self, name: str) -> _Marker | None:
        if name == SUITE:
            return _Marker((self.suite,))
        return _Marker(()) if name in self.markers else None


def _selection() -> list[_Item]:
    """A selection shaped like the CPU lane's: a family's shared-compile suite, cases in three
    modes, tests without parameters, and the mutant catalogue."""
    items = []
    for family, suite, cases, shared in (
        ("ar", "numerics", 6, True),
        ("ar", "decode", 5, False),
        ("dit", "image", 4, False),
        ("routing", "routing", 9, False),
    ):
        for case in range(cases):
            for mode in ("eager", "cpu_graph", "compiled"):
                path = Path(f"parity/suites/{family}/test_{suite}.py")
                params = {"mode": mode, "case": f"{suite}-{case}"}
                items.append(
                    _Item(path, f"{path}::t[{mode}-{case}]", _Callspec(params), (KEEP_COMPILE_CACHE,) if shared else (), suite)
                )
    for n in range(3):
        path = Path("parity/suites/selfcheck/test_selfcheck.py")
        items.append(_Item(path, f"{path}::t{n}", _Callspec({}), (), "selfcheck"))
    for n in range(7):
        path = Path("parity/suites/sensitivity/test_sensitivity.py")
        items.append(_Item(path, f"{path}::t[m{n}]", _Callspec({"name": f"m{n}"}), (), "sensitivity"))
    return items


def _problems(items: list[_Item], shard_of: list[int], count: int) -> list[str]:
    """What a plan must never do: leave a test out, split a unit, or load a shard with more than
    another's load plus the largest unit (what dealing costliest-first guarantees)."""
    problems = []
    if len(shard_of) != len(items) or not all(0 <= s < count for s in shard_of):
        problems.append("a test without exactly one shard")
    units: dict[tuple[str, ...], set[int]] = collections.defaultdict(set)
    costs: dict[tuple[str, ...], float] = collections.defaultdict(float)
    for item, s in zip(items, shard_of):
        units[shards.unit_of(item)].add(s)
        costs[shards.unit_of(item)] += shards.item_cost(item)
    problems += [f"unit {unit} split over shards {sorted(where)}" for unit, where in units.items() if len(where) > 1]
    load = [0.0] * count
    for item, s in zip(items, shard_of):
        load[s] += shards.item_cost(item)
    if max(load) - min(load) > max(costs.values()):
        problems.append(f"unbalanced: loads {load}")
    return problems


@pytest.mark.parametrize("count", [2, 3, 5])
def test_every_test_in_one_shard_units_whole_loads_balanced(count: int) -> None:
    items = _selection()
    assert _problems(items, shards.assign(items, count), count) == []


def test_a_plan_that_splits_units_is_caught() -> None:
    """The switched-off variant: dealing tests round robin (no units, no costs) splits the shared
    compiles and the cases, which `_problems` names."""
    items = _selection()
    problems = _problems(items, [i % 2 for i in range(len(items))], 2)
    assert any("shared compiled code" in line for line in problems), problems
    assert any("decode-0" in line for line in problems), problems


def test_the_plan_does_not_depend_on_the_order_of_collection() -> None:
    """Shards on different machines cut the same plan: the same selection in another order gives
    every test the same shard."""
    items = _selection()
    shuffled = list(items)
    random.Random(3).shuffle(shuffled)
    first = dict(zip((i.nodeid for i in items), shards.assign(items, 3)))
    second = dict(zip((i.nodeid for i in shuffled), shards.assign(shuffled, 3)))
    assert first == second


def test_the_mutant_catalogue_is_dealt_last() -> None:
    """Rank 0 alone runs the catalogue at --tp N: the other tests' shards must not depend on it."""
    items = _selection()
    without = [item for item in items if item.suite != "sensitivity"]
    full = dict(zip((i.nodeid for i in items), shards.assign(items, 2)))
    assert dict(zip((i.nodeid for i in without), shards.assign(without, 2))) == {i.nodeid: full[i.nodeid] for i in without}


@pytest.mark.parametrize(("text", "message"), [("3/2", "between 1 and 2"), ("0/2", "between 1 and 2"), ("1-2", "expected K/N")])
def test_a_shard_that_is_not_k_of_n_is_refused(text: str, message: str, tmp_path: Path) -> None:
    result = run_parity(["run", "--shard", text, "--report-dir", str(tmp_path)])
    assert result.returncode == 4, result.stdout + result.stderr
    assert "--shard" in result.stderr and text in result.stderr and message in result.stderr
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# The CPU lane in two shards (two shared runs), merged
# ---------------------------------------------------------------------------------------------


def _gate_rows(frame: pd.DataFrame) -> collections.Counter:
    gates = frame[frame["kind"] == "gate"]
    keys = ["suite", "case", "mode", "site", "metric", "verdict"]
    return collections.Counter(map(tuple, gates[keys].astype(str).to_numpy().tolist()))


@pytest.mark.parity_slow
def test_the_lane_in_two_shards_merges_into_the_one_machine_run(
    quick_shard_1: SharedRun, quick_shard_2: SharedRun, quick_lane_run: SharedRun, tmp_path: Path
) -> None:
    """The quick lane (every suite but the mutant catalogue, eager and the graph stand-in, compiles
    traced without code generation) in two shards, merged, against the same selection on one
    machine. The mutant catalogue's rows merge as any rows do (`test_good_shards_merge` counts a
    score through a merge); the plan deals it last (`test_the_mutant_catalogue_is_dealt_last`)."""
    for shard in (quick_shard_1, quick_shard_2):
        assert shard.returncode == quick_lane_run.returncode == 0, shard.stdout[-4000:]
    plans = [read_run_info(shard.run_dir)["shard"] for shard in (quick_shard_1, quick_shard_2)]
    assert plans[0]["tests"] and plans[1]["tests"] and plans[0]["tests"] + plans[1]["tests"] == plans[0]["selection_tests"]
    merged = tmp_path / "merged"
    result = run_parity(["merge", str(quick_shard_1.run_dir), str(quick_shard_2.run_dir), "--into", str(merged)])
    assert result.returncode == 0, result.stdout + result.stderr
    # The same gate rows with the same verdicts as the one-machine run, row for row, every suite there.
    merged_rows = read_results(merged)
    assert _gate_rows(merged_rows) == _gate_rows(quick_lane_run.rows)
    assert set(merged_rows["suite"]) == set(quick_lane_run.rows["suite"]) and len(set(merged_rows["suite"])) >= 10
    assert set(merged_rows["size"]) == {"tiny-quick"}  # a quick run, merged as one
    # `parity review` reads it like any run: against the one-machine run, clean.
    review = run_parity(["review", str(merged), "--baseline", str(quick_lane_run.run_dir)])
    assert review.returncode == 0, review.stdout + review.stderr
    assert "regressions: 0" in review.stdout and "vanished cases: 0" in review.stdout, review.stdout
    assert [shard["index"] for shard in read_run_info(merged)["merged_from"]] == [1, 2]

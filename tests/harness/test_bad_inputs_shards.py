"""Bad input of `parity merge`: shards that are not the parts of one run. Each row hands `parity merge`
shard runs with one mistake (another tree, target, torch version, seed or selection; a part given
twice or missing; rows of one test in two shards; a directory that is not a shard or did not
complete; an --into that holds something) and names the words of the one line that must explain
it, checked as tests/harness/test_bad_inputs.py checks its table (`check_bad_input`: exit 2, exactly
one line holding the words, no traceback, nothing written). `test_the_checks_are_what_catch_these`
switches the shard checks off and shows each row merge silently (exit 0); `test_good_shards_merge`
is the control every row changes one thing of.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from parity.report import ReportWriter, mutation_score, read_results, read_run_info, write_run_info
from tests.support.bad_input_table import Bad, Outcome, check_bad_input, cli

pytestmark = pytest.mark.parity_cpu

CONTEXT = {
    "target": "serving",
    "device": "cpu",
    "dtype": "fp32",
    "size": "tiny",
    "torch_version": "2.13.0+cpu",
    "tp": "1",
    "worker": "main",
}
TESTS = {1: ["suites/ar/test_a.py::t[c0]", "suites/ar/test_a.py::t[c1]"], 2: ["suites/dit/test_b.py::t[c2]"]}
SHARD = {"count": 2, "selection": "5e1ec7", "selection_tests": 3, "tree": "git:0123456789abcdef"}
PROVENANCE = {"spec": "serving", "factory": "serving_models.target:make_target", "name": "serving", "git_sha": "abc"}


def make_shard(
    run_dir: Path,
    index: int,
    *,
    tests: list[str] | None = None,
    shard: dict | None = None,
    killed: dict[str, str] | None = None,
    **info: Any,
) -> Path:
    """A finished shard run as `parity run --shard K/2` writes one (run.json at its first row);
    `killed`: the mutant catalogue's rows its first test writes (mutant -> verdict)."""
    tests = TESTS[index] if tests is None else tests
    run_info = {
        "run_id": run_dir.name,
        "status": "complete",
        "pid": os.getpid(),
        "host": os.uname().nodename,
        "seed": 0,
        "torch": CONTEXT["torch_version"],
        "tp": 1,
        "git_sha": "abc",
        "target_provenance": PROVENANCE,
        "shard": {**SHARD, "index": index, "tests": len(TESTS[index]), **(shard or {})},
        **{k: CONTEXT[k] for k in ("device", "dtype", "size", "target")},
    }
    run_info.update(info)
    writer = ReportWriter(run_dir, {**CONTEXT, "run_id": run_dir.name}, on_create=lambda d: write_run_info(d, run_info))
    for n, test in enumerate(tests):
        writer.write(
            {
                "suite": "numerics",
                "case": f"c{index}-{n}",
                "metric": "max_abs",
                "value": 0.0,
                "threshold": 1.0,
                "verdict": "pass",
                "test": test,
            }
        )
    for mutant, verdict in (killed or {}).items():
        row = {"suite": "sensitivity", "case": mutant, "mode": "numerics", "metric": "killed", "value": float(verdict == "pass")}
        writer.write({**row, "threshold": 1.0, "verdict": verdict, "test": tests[0]})
    return run_dir


def merging(
    second: dict[str, Any] | None = None, *, first: dict[str, Any] | None = None, extra: int | None = None, into: str = ""
) -> Any:
    """`parity merge` of shard 1 and shard 2 (with `first` / `second` changes; `extra`: one more shard
    of that index); nothing may be written to --into when it is refused."""

    def run(tmp_path: Path) -> Outcome:
        dirs = [make_shard(tmp_path / "s1", 1, **(first or {}))]
        if second is not None:
            dirs.append(make_shard(tmp_path / "s2", **{"index": 2, **second}))
        if extra is not None:
            dirs.append(make_shard(tmp_path / "s3", extra))
        target = tmp_path / "merged"
        if into:
            target.mkdir()
            (target / into).write_text("mine")
        outcome = cli("merge", *dirs, "--into", target)
        written = target.exists() and any(p.name != into for p in target.iterdir())
        outcome.preserved = outcome.code == 0 or not written
        return outcome

    return run


def not_a_shard(tmp_path: Path) -> Outcome:
    run_dir = make_shard(tmp_path / "s1", 1)
    info = read_run_info(run_dir)
    info.pop("shard")
    write_run_info(run_dir, info)
    return cli("merge", run_dir, make_shard(tmp_path / "s2", 2), "--into", tmp_path / "merged")


# fmt: off
BAD_SHARDS = [
    Bad("merge-different-tree", merging({"shard": {"tree": "git:fedcba9876543210"}}), ("shard 2/2", "tree git:fedcba9876543210", "shards of different trees")),
    Bad("merge-different-commit", merging({"git_sha": "def-dirty"}), ("shard 2/2", "(git def-dirty)", "shards of different trees")),
    Bad("merge-different-target", merging({"target_provenance": {**PROVENANCE, "version": "2.0"}}), ("shard 2/2", "target (", "'2.0'")),
    Bad("merge-different-torch", merging({"torch": "2.11.0"}), ("shard 2/2", "torch '2.11.0'", "has '2.13.0+cpu'")),
    Bad("merge-different-seed", merging({"seed": 7}), ("shard 2/2", "seed 7", "has 0")),
    Bad("merge-different-selection", merging({"shard": {"selection": "0ther5e1"}}), ("shard 2/2", "part of selection 0ther5e1", "shards of different selections")),
    Bad("merge-different-count", merging({"shard": {"count": 3}}), ("shard 2/3", "in 3", "shards of different selections")),
    Bad("merge-shard-twice", merging({}, extra=1), ("shard 1/2 given 2 times",)),
    Bad("merge-missing-part", merging(None), ("missing part(s) of the 2 shards: 2/2",)),
    Bad("merge-overlapping-parts", merging({"tests": [TESTS[1][0]]}), ("both hold rows of suites/ar/test_a.py::t[c0]", "overlapping parts")),
    Bad("merge-parts-do-not-add-up", merging({"shard": {"tests": 2}}), ("the shards' parts hold 4 tests, the selection 3",)),
    Bad("merge-shard-not-complete", merging({"status": "interrupted", "signal": "SIGTERM"}), ("shard 2/2", "is not a whole run", "interrupted (SIGTERM)", "--append")),
    Bad("merge-not-a-shard", not_a_shard, ("not a shard (run.json has no 'shard')", "--shard K/N")),
    Bad("merge-into-not-empty", merging({}, into="notes.md"), ("--into", "exists and is not empty")),
]
# fmt: on


@pytest.mark.parametrize("row", [pytest.param(row, id=row.id) for row in BAD_SHARDS])
def test_bad_input(row: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outcome = check_bad_input(row, tmp_path, monkeypatch)
    assert outcome.code == 2, outcome.output  # docs/cli.md §6: merge refused


def test_good_shards_merge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control of every row: the two shards merge into one run (its rows under one run id, each
    worker naming its shard, run.json listing both shards) that reviews clean."""
    monkeypatch.chdir(tmp_path)
    outcome = merging({})(tmp_path)
    assert outcome.code == 0, outcome.output
    merged = tmp_path / "merged"
    rows = read_results(merged)
    assert set(rows["run_id"]) == {"merged"} and len(rows) == 3
    assert sorted(set(rows["worker"])) == ["shard-1/main", "shard-2/main"]
    info = read_run_info(merged)
    assert [shard["index"] for shard in info["merged_from"]] == [1, 2] and info["status"] == "complete"
    assert "shard" not in info and info["selection"]["selection_tests"] == 3
    review = cli("review", merged, "--no-baseline")
    assert review.code == 0, review.output


def test_the_mutation_score_is_the_shards_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant catalogue's rows split over two shards: the merged run's score counts both."""
    monkeypatch.chdir(tmp_path)
    dirs = [
        make_shard(tmp_path / "s1", 1, killed={"eps": "pass", "bias": "pass"}),
        make_shard(tmp_path / "s2", 2, killed={"theta": "fail"}),
    ]
    outcome = cli("merge", *dirs, "--into", tmp_path / "merged")
    assert outcome.code == 0, outcome.output
    score = mutation_score(read_results(tmp_path / "merged"))
    assert score is not None and (score.killed, score.applicable, score.survivors) == (2, 3, ["theta"])


def _shards_unchecked(patch: pytest.MonkeyPatch) -> None:
    patch.setattr("parity.report.merge.check_shards", lambda runs: [])


def _incomplete_accepted(patch: pytest.MonkeyPatch) -> None:
    patch.setattr("parity.report.merge.completeness", lambda run: [])


def _any_into(patch: pytest.MonkeyPatch) -> None:
    patch.setattr("parity.report.merge.check_into", lambda into: None)


# Every row but merge-not-a-shard (without a shard record there is nothing to merge by).
SWITCHED_OFF = {
    **{
        row.id: _shards_unchecked
        for row in BAD_SHARDS
        if row.id not in ("merge-not-a-shard", "merge-into-not-empty", "merge-shard-not-complete")
    },
    "merge-shard-not-complete": _incomplete_accepted,
    "merge-into-not-empty": _any_into,
}


@pytest.mark.parametrize("row_id", sorted(SWITCHED_OFF))
def test_the_checks_are_what_catch_these(row_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check switched off (a broken variant of `parity merge`): the row's shards merge
    silently into one run (exit 0)."""
    monkeypatch.chdir(tmp_path)
    SWITCHED_OFF[row_id](monkeypatch)
    row = next(row for row in BAD_SHARDS if row.id == row_id)
    outcome = row.run(tmp_path)
    assert outcome.code == 0, outcome.output

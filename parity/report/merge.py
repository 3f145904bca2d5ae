"""`parity merge RUN_DIR... --into RUN`: the runs of a sharded lane (`--shard K/N` on N machines)
made one run that `parity review` reads like any other.

The shards are checked before anything is written, and every mistake is one line: a directory that
is not a finished shard (no rows, no `shard` in run.json, a run that did not complete), shards of
different trees, targets, torch versions, seeds, configurations or selections, a shard given twice,
a part missing, rows of one test in two shards. The merged run's rows are the shards' records as
they were written (text, not re-formatted numbers) under one run id, each row's `worker` saying its
shard (`shard-2/gw0`); its run.json is the shards' common configuration with each shard's
provenance under `merged_from` (docs/reports.md §9).
"""

from __future__ import annotations

import csv
import dataclasses
import filecmp
import io
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parity.report.run_files import RunFiles, completeness
from parity.report.run_info import now_text, write_run_info
from parity.report.rundir import OWNER_FILE, atomic_write, refuse_link
from parity.report.schema import COLUMNS, COMPLETE, RESULTS_FILE, RUN_INFO_FILE, ReportError

# What every shard of one run shares, as run.json spells it (the tree and the target are checked apart).
SAME_KEYS = ("device", "size", "dtype", "seed", "tp", "checkpoint_layout", "torch")
TARGET_KEYS = ("spec", "factory", "distribution", "version", "git_sha", "name")
# A run directory's own files: made again for the merged run, or kept with the shard.
NOT_COPIED = {RESULTS_FILE, RUN_INFO_FILE, OWNER_FILE, "index.html", "review", "ranks"}


class MergeError(ValueError):
    """Shards that cannot be one run: one line per problem (`lines`)."""

    def __init__(self, lines: Sequence[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = list(lines)


@dataclasses.dataclass(frozen=True)
class ShardRun:
    run_dir: Path
    info: dict[str, Any]
    header: list[str]
    records: list[dict[str, str]]

    @property
    def shard(self) -> dict[str, Any]:
        return self.info["shard"]

    @property
    def name(self) -> str:
        return f"shard {self.shard['index']}/{self.shard['count']} ({self.run_dir})"


def _read(run_dir: Path) -> ShardRun:
    """A shard's run (read once: `RunFiles`), or a MergeError line saying why it is not one."""
    refuse_link(run_dir, "a shard's run directory")
    if not (run_dir / RESULTS_FILE).is_file() or not (run_dir / RUN_INFO_FILE).is_file():
        raise MergeError([f"{run_dir}: not a run directory (no {RESULTS_FILE} or no {RUN_INFO_FILE})"])
    files = RunFiles.read(run_dir)
    info = files.info
    if not isinstance(info.get("shard"), dict):
        raise MergeError([f"{run_dir}: not a shard (run.json has no 'shard'): run each part with --shard K/N"])
    records = files.records
    if records.header != list(COLUMNS):
        raise MergeError([f"{run_dir / RESULTS_FILE}: columns {records.header} are not this parity's ({', '.join(COLUMNS)})"])
    run = ShardRun(run_dir, info, records.header, [record for _, record in records.whole])
    problems = completeness(files)
    if problems:
        raise MergeError([f"{run.name} is not a whole run: {problems[0]} (run it again with --append --run-id {run_dir.name})"])
    return run


def _target(info: dict[str, Any]) -> tuple[Any, ...]:
    provenance = info.get("target_provenance") or {}
    return (info.get("target"), *(provenance.get(key) for key in TARGET_KEYS))


def check_shards(runs: Sequence[ShardRun]) -> list[str]:
    """Why `runs` are not the parts of one run (one line each); empty when they are."""
    first = runs[0]
    lines = []
    for run in runs[1:]:
        for key in SAME_KEYS:
            if run.info.get(key) != first.info.get(key):
                lines.append(f"{run.name}: {key} {run.info.get(key)!r}, but {first.name} has {first.info.get(key)!r}")
        if (run.shard.get("tree"), run.info.get("git_sha")) != (first.shard.get("tree"), first.info.get("git_sha")):
            lines.append(
                f"{run.name}: tree {run.shard.get('tree')} (git {run.info.get('git_sha')}), but {first.name} ran "
                f"{first.shard.get('tree')} (git {first.info.get('git_sha')}): shards of different trees"
            )
        if _target(run.info) != _target(first.info):
            lines.append(f"{run.name}: target {_target(run.info)}, but {first.name} has {_target(first.info)}")
        if (run.shard.get("selection"), run.shard.get("count")) != (first.shard.get("selection"), first.shard.get("count")):
            lines.append(
                f"{run.name}: part of selection {run.shard.get('selection')} ({run.shard.get('selection_tests')} tests) in "
                f"{run.shard.get('count')}, but {first.name} is part of {first.shard.get('selection')} "
                f"({first.shard.get('selection_tests')} tests) in {first.shard.get('count')}: shards of different selections"
            )
    if lines:
        return lines
    count = int(first.shard["count"])
    by_index: dict[int, list[ShardRun]] = {}
    for run in runs:
        by_index.setdefault(int(run.shard["index"]), []).append(run)
    for index, same in sorted(by_index.items()):
        if len(same) > 1:
            lines.append(f"shard {index}/{count} given {len(same)} times: {', '.join(str(run.run_dir) for run in same)}")
    missing = [index for index in range(1, count + 1) if index not in by_index]
    if missing:
        lines.append(f"missing part(s) of the {count} shards: {', '.join(f'{index}/{count}' for index in missing)}")
    owner: dict[str, ShardRun] = {}
    for run in runs:
        for test in sorted({record["test"] for record in run.records if record["test"]}):
            other = owner.setdefault(test, run)
            if other is not run and other.shard["index"] != run.shard["index"]:
                lines.append(f"{other.name} and {run.name} both hold rows of {test}: overlapping parts")
                break
    if not lines and sum(int(run.shard["tests"]) for run in runs) != int(first.shard["selection_tests"]):
        lines.append(
            f"the shards' parts hold {sum(int(run.shard['tests']) for run in runs)} tests, the selection "
            f"{first.shard['selection_tests']}: not the parts of one selection"
        )
    return lines


def _rows_text(runs: Sequence[ShardRun], run_id: str) -> str:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(COLUMNS)
    for run in runs:
        label = f"shard-{run.shard['index']}"
        for record in run.records:
            worker = f"{label}/{record['worker']}" if record["worker"] else label
            merged = {**record, "run_id": run_id, "worker": worker}
            writer.writerow([merged[column] for column in COLUMNS])
    return text.getvalue()


def _artifacts(runs: Sequence[ShardRun]) -> dict[Path, Path]:
    """Every other file of the shards (repros, images) by its place in the merged run; a name two
    shards hold with different content is a MergeError."""
    found: dict[Path, Path] = {}
    clashes = []
    for run in runs:
        for path in sorted(run.run_dir.rglob("*")):
            relative = path.relative_to(run.run_dir)
            if relative.parts[0] in NOT_COPIED or path.is_dir() or path.is_symlink():
                continue
            if relative in found and not filecmp.cmp(found[relative], path, shallow=False):
                clashes.append(f"{relative} differs between {found[relative].parent} and {path.parent}")
            found.setdefault(relative, path)
    if clashes:
        raise MergeError(clashes[:5])
    return found


def check_into(into: Path) -> None:
    """The merged run is a new run directory: never a link, never one that holds anything."""
    refuse_link(into, "--into")
    if into.exists() and (not into.is_dir() or any(into.iterdir())):
        raise MergeError([f"--into {into}: exists and is not empty: the merged run is a new run directory"])


def merge_runs(run_dirs: Sequence[Path], into: Path) -> dict[str, Any]:
    """Make the run `into` from the shards in `run_dirs`; returns its run.json. Nothing is written
    unless every shard is a part of one run (MergeError, one line each problem) and `into` is free."""
    if not run_dirs:
        raise MergeError(["no shard given"])
    check_into(into)
    problems: list[str] = []
    runs: list[ShardRun] = []
    for run_dir in run_dirs:
        try:
            runs.append(_read(Path(run_dir)))
        except (MergeError, ReportError, OSError, ValueError) as exc:
            problems += exc.lines if isinstance(exc, MergeError) else [f"{run_dir}: {exc}"]
    if problems:
        raise MergeError(problems)
    problems = check_shards(runs)
    if problems:
        raise MergeError(problems)
    runs.sort(key=lambda run: int(run.shard["index"]))
    artifacts = _artifacts(runs)
    info = _merged_info(runs, into.name)
    into.mkdir(parents=True, exist_ok=True)
    for relative, source in artifacts.items():
        (into / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, into / relative)
    write_run_info(into, info)
    atomic_write(into / RESULTS_FILE, _rows_text(runs, into.name))
    return info


def _merged_info(runs: Sequence[ShardRun], run_id: str) -> dict[str, Any]:
    first = runs[0].info
    info = {key: value for key, value in first.items() if key not in ("shard", "pid", "host", "previous_sessions")}
    seconds: dict[str, float] = {}
    for run in runs:
        for suite, value in (run.info.get("suite_seconds") or {}).items():
            seconds[suite] = round(seconds.get(suite, 0.0) + float(value), 3)
    args = list(first.get("args") or [])
    for flag in ("--parity-shard", "--shard"):
        while flag in args:
            at = args.index(flag)
            del args[at : at + 2]
    disagreements = [line for run in runs for line in (run.info.get("rank_disagreements") or [])]
    info.update(
        run_id=run_id,
        status=COMPLETE,
        reason=None,
        signal=None,
        args=args,
        started=min(str(run.info.get("started", "")) for run in runs),
        ended=max(str(run.info.get("ended", "")) for run in runs),
        exitstatus=max(int(run.info.get("exitstatus") or 0) for run in runs),
        merged=now_text(),
        suite_seconds=seconds or None,
        rank_disagreements=disagreements or None,
        selection={key: runs[0].shard[key] for key in ("selection", "selection_tests", "count", "tree")},
        merged_from=[
            {
                "index": run.shard["index"],
                "count": run.shard["count"],
                "run_dir": str(run.run_dir.resolve()),
                "run_id": run.info.get("run_id"),
                "host": run.info.get("host"),
                "started": run.info.get("started"),
                "ended": run.info.get("ended"),
                "exitstatus": run.info.get("exitstatus"),
                "rows": len(run.records),
                "tests": run.shard["tests"],
                "cpu_kernels": run.info.get("cpu_kernels"),
                "device_name": run.info.get("device_name"),
            }
            for run in runs
        ],
    )
    return {key: value for key, value in info.items() if value is not None}

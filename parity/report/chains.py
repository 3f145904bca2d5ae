"""Stage chains read back from a run's rows: where inside the model a failing case diverged.

When a gate row of a case fails, the suite re-runs the case with stage taps and writes, under the
same (suite, case, mode), one info row per stage of its family in execution order (its RMSE
against the fp64 golden and its noise-derived bound, or why it was not judged: the row's data,
`status`), one `first_diverging_stage` row naming the stage blamed (its data: the chain's
`summary` and the `repro`'s path inside the run directory, '' when none was written) and, when only the compiled target
diverged, a `compile_only_piece` row naming the smallest compiled module that differs from itself
run eagerly (docs/localise.md). The review prints the blamed stage beside a failing case's line;
the page draws each chain.

The report layer imports only `parity.compare` (tests/repo/test_layering.py), so the metric names
are repeated here; tests/report/test_review_stages.py holds them equal to `parity.localise.rows`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path, PurePosixPath

import pandas as pd

from parity.compare import FAIL, NOT_APPLICABLE, PASS
from parity.report.schema import row_data

STAGE_METRIC = "stage_rmse_vs_golden"  # a float stage: RMSE vs the fp64 golden, bound from the noise floor
EXACT_METRIC = "stage_mismatches"  # an exact stage (ids, masks): entries differing from the reference, bound 0
BLAME_METRIC = "first_diverging_stage"
PIECE_METRIC = "compile_only_piece"
STAGE_METRICS = (STAGE_METRIC, EXACT_METRIC)
LOCALISE_METRICS = (*STAGE_METRICS, BLAME_METRIC, PIECE_METRIC)

# A per-layer (per-block) site: `layer.3.q_rope` is in group `layer.3`; `embed`, `lm_head` are in none.
_GROUP = re.compile(r"^(?P<group>[A-Za-z_]+\.\d+)\.")
# A stage not judged: its detail starts with why (parity.localise.chain's NOT_* statuses).
_NOT_JUDGED = {
    "not_observable": "not observable",
    "not_observed": "not observed",
    "not_comparable": "not comparable",
}

WITHIN, DIVERGED, BLAMED = "within bound", "diverged", "first diverging"


def localise_mask(frame: pd.DataFrame) -> pd.Series:
    """The rows a localisation wrote (info rows of the stage metrics): kept out of the suites' views."""
    return frame["metric"].isin(LOCALISE_METRICS) & (frame["kind"] == "info")


def site_group(site: str) -> str:
    """`layer.3` for `layer.3.q_rope`; '' for a stage outside the per-layer ones."""
    match = _GROUP.match(site or "")
    return match["group"] if match else ""


def stage_status(row: pd.Series, blamed: str = "") -> str:
    """How a stage row reads: within bound, diverged, first diverging, or why it was not judged."""
    if row["verdict"] == NOT_APPLICABLE:
        return _NOT_JUDGED.get(str(row_data(row["data"]).get("status", "")), "not judged")
    if row["verdict"] == PASS:
        return WITHIN
    return BLAMED if blamed and row["site"] == blamed else DIVERGED


def stage_what(row: pd.Series) -> str:
    """What the stage is (its detail, without the `status: ` a stage not judged starts with)."""
    detail = str(row["detail"])
    status = row_data(row["data"]).get("status") if row["verdict"] == NOT_APPLICABLE else None
    return detail.removeprefix(f"{status}: ") if status else detail


def share_of_bound(value: float, bound: float) -> float:
    """value / bound: 1.0 is at the bound; an exact stage (bound 0) is 0 when equal, inf when not."""
    if value is None or bound is None or pd.isna(value) or pd.isna(bound):
        return math.nan
    if bound > 0:
        return value / bound
    return 0.0 if value == 0 else math.inf


@dataclasses.dataclass(frozen=True)
class StageChain:
    """One localisation of a case: its stage rows in execution order and the row naming the stage blamed."""

    stages: pd.DataFrame
    blame: pd.Series | None

    @property
    def blamed(self) -> str:
        """The site blamed ('' when no stage diverged beyond its bound)."""
        if self.blame is None or self.blame["verdict"] != FAIL:
            return ""
        return str(self.blame["site"])

    @property
    def summary(self) -> str:
        """The blame row's one-line summary, without its repro path (its data's `summary`)."""
        if self.blame is None:
            return "no first_diverging_stage row: the localisation did not finish"
        return str(row_data(self.blame["data"]).get("summary", self.blame["detail"]))

    @property
    def repro(self) -> str:
        """The repro's path relative to the run directory, as the blame row's data gives it ('' when none)."""
        return str(row_data(self.blame["data"]).get("repro", "")) if self.blame is not None else ""

    def focus(self) -> str:
        """The stage the chain's table opens up: the blamed one, else the first that diverged."""
        if self.blamed:
            return self.blamed
        diverged = self.stages[self.stages["verdict"] == FAIL]
        return str(diverged["site"].iloc[0]) if not diverged.empty else ""


@dataclasses.dataclass(frozen=True)
class Localised:
    """Every localisation of one (suite, case, mode): its chains and the compile-only pieces named."""

    suite: str
    case: str
    mode: str
    chains: list[StageChain]
    pieces: pd.DataFrame

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.suite, self.case, self.mode)


def localised_cases(frame: pd.DataFrame) -> list[Localised]:
    """Per (suite, case, mode) with localisation rows, in the order first written. A case localised
    more than once (several comparisons of one case, or a resumed run) has one chain per
    `first_diverging_stage` row, each made of the stage rows written since the one before; stage
    rows with no blame row after them (a localisation cut short) are a chain of their own."""
    rows = frame[localise_mask(frame)]
    found = []
    for (suite, case, mode), group in rows.groupby(["suite", "case", "mode"], sort=False):
        group = group.sort_index(kind="stable")
        chains: list[StageChain] = []
        pending: list[int] = []
        for index, metric in zip(group.index, group["metric"]):
            if metric in STAGE_METRICS:
                pending.append(index)
            elif metric == BLAME_METRIC:
                chains.append(StageChain(group.loc[pending], group.loc[index]))
                pending = []
        if pending:
            chains.append(StageChain(group.loc[pending], None))
        found.append(Localised(str(suite), str(case), str(mode), chains, group[group["metric"] == PIECE_METRIC]))
    return found


def case_notes(frame: pd.DataFrame, run_dir: Path | None = None) -> dict[tuple[str, str, str], str]:
    """Per (suite, case, mode): what its localisation found, in a few words for the review's line
    (`first diverging stage layer.0.q_rope, repro: RUN_DIR/repro/<case>/repro.py`; the compiled piece)."""
    notes = {}
    for found in localised_cases(frame):
        parts = []
        for chain in found.chains:
            if chain.blamed:
                repro = (run_dir / chain.repro if run_dir is not None else chain.repro) if chain.repro else ""
                parts.append(f"first diverging stage {chain.blamed}" + (f", repro: {repro}" if repro else ""))
        parts += [f"compiled piece {site} differs from its eager run" for site in found.pieces["site"] if site]
        if parts:
            notes[found.key] = "; ".join(dict.fromkeys(parts))
    return notes


def repro_file(run_dir: Path, relative: str) -> Path | None:
    """The repro file a blame row names, when it is a relative path to a regular file inside the
    run directory (a row is never trusted to point elsewhere); None otherwise."""
    if not relative:
        return None
    path = PurePosixPath(relative)
    if path.is_absolute() or ".." in path.parts:
        return None
    candidate = run_dir / path
    try:
        inside = run_dir.resolve() in candidate.resolve().parents
    except OSError:
        return None
    return candidate if inside and candidate.is_file() and not candidate.is_symlink() else None


FULL_CHAIN = 40  # a chain of at most this many stages is listed whole; a longer one folds its other layers
LINE_COLUMNS = ("#", "site", "stage", "status", "value", "bound", "value/bound")


def _line(position: int | str, row: pd.Series, blamed: str) -> dict[str, object]:
    status = stage_status(row, blamed)
    klass = {BLAMED: "blamed", DIVERGED: FAIL, WITHIN: PASS}.get(status, NOT_APPLICABLE)
    return {
        "#": position,
        "site": row["site"],
        "stage": stage_what(row),
        "status": status,
        "value": row["value"],
        "bound": row["threshold"],
        "value/bound": share_of_bound(row["value"], row["threshold"]),
        "_class": klass,
    }


def _folded(group: str, rows: pd.DataFrame, first: int) -> dict[str, object]:
    """One line for a whole layer: how many of its stages diverged, and its worst stage against its bound."""
    statuses = [stage_status(row) for _, row in rows.iterrows()]
    counts = {status: statuses.count(status) for status in dict.fromkeys(sorted(statuses, key=lambda s: s != DIVERGED))}
    shares = [share_of_bound(v, b) for v, b in zip(rows["value"], rows["threshold"])]
    judged = [(share, i) for i, share in enumerate(shares) if not math.isnan(share)]
    worst = rows.iloc[max(judged)[1]] if judged else None
    status = "all within bound" if counts.get(WITHIN) == len(rows) else ", ".join(f"{n} {s}" for s, n in counts.items())
    return {
        "#": f"{first}-{first + len(rows) - 1}",
        "site": f"{group}.*",
        "stage": f"{len(rows)} stages"
        + (f"; worst against its bound: {worst['site'].removeprefix(group + '.')}" if worst is not None else ""),
        "status": status,
        "value": worst["value"] if worst is not None else math.nan,
        "bound": worst["threshold"] if worst is not None else math.nan,
        "value/bound": max(judged)[0] if judged else math.nan,
        "_class": f"{FAIL} folded" if DIVERGED in counts else "folded",
    }


def chain_lines(chain: StageChain, limit: int = FULL_CHAIN) -> tuple[pd.DataFrame, int]:
    """The chain as table lines (`LINE_COLUMNS`, `_class` the row's CSS class), in execution order.

    A chain of at most `limit` stages is listed whole. A longer one (a full-size model has hundreds)
    lists every stage outside the layers, every stage of the layer holding the blamed stage (else
    the first that diverged), and one line per other layer: how many of its stages diverged and its
    worst stage against its bound. Returns the lines and how many layers were folded."""
    stages = chain.stages.reset_index(drop=True)
    blamed = chain.blamed
    if len(stages) <= limit:
        return pd.DataFrame([_line(i, row, blamed) for i, row in stages.iterrows()], columns=[*LINE_COLUMNS, "_class"]), 0
    groups = stages["site"].map(site_group)
    open_group = site_group(chain.focus())
    lines, folded, i = [], 0, 0
    while i < len(stages):
        group = groups[i]
        if not group or group == open_group:
            lines.append(_line(i, stages.iloc[i], blamed))
            i += 1
            continue
        end = i
        while end < len(stages) and groups[end] == group:
            end += 1
        lines.append(_folded(group, stages.iloc[i:end], i))
        folded += 1
        i = end
    return pd.DataFrame(lines, columns=[*LINE_COLUMNS, "_class"]), folded

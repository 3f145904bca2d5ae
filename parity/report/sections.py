"""The review page's sections that every run has, as data: what failed (the summary), where each
localised case diverges, what changed against the baseline, all rows by suite, the environment,
and the families the target does not provide (templates/sections/*.html.j2 draw them).

The page is sized to what ran: a `skip` row (a suite test that did not run, with pytest's reason)
is never listed row by row; they are counted, one line per distinct reason. A family the target
leaves out (`family_not_provided` rows, one per suite of that family) is one line at the top, in
no table: its name and the members the target lacks come from the row's `data` (docs/reports.md §4).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from parity.compare import ERROR, FAIL, NOT_APPLICABLE, SKIP, TIE_FLIP
from parity.report import case_lines
from parity.report.chains import LINE_COLUMNS, Localised, StageChain, chain_lines, localised_cases, repro_file
from parity.report.comparison import INFO_LIST_FACTOR
from parity.report.html import SEVERITY, Assets, Table, gate_verdict, href, table
from parity.report.plots import stage_chain_plot
from parity.report.review import Review, failing_first, failing_suites_first
from parity.report.schema import NOT_PROVIDED, RESULTS_FILE, RUN_INFO_FILE, row_data
from parity.report.summary import summarize

ROW_COLUMNS = ("verdict", "case", "mode", "site", "metric", "value", "threshold", "better", "kind", "detail")
LOCALISE_ANCHOR = "localise"
MAX_LOCALISED = 12  # localised cases drawn in full (table and plot); more are one line each
OUTCOME_COLUMNS = (
    "suite",
    "case",
    "mode",
    "site",
    "metric",
    "old_value",
    "new_value",
    "threshold",
    "bound",
    "old_verdict",
    "new_verdict",
    "why",
)


def suites_in(frame: pd.DataFrame) -> list[str]:
    """The suites that have rows in this run, failing suites first, then by name."""
    if frame.empty:
        return []
    names = frame["suite"].unique()
    return sorted(names, key=lambda s: (-SEVERITY.get(gate_verdict(frame[frame["suite"] == s]), 0), s))


# ---------------------------------------------------------------------------------------------
# What ran, what did not
# ---------------------------------------------------------------------------------------------


def family_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The `family_not_provided` rows: one per (family the target leaves out, suite of it)."""
    return frame[(frame["metric"] == NOT_PROVIDED) & (frame["verdict"] == SKIP)]


def listed(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows the suite sections read: every row but the `family_not_provided` ones (those are
    one line per family at the top of the page)."""
    return frame.drop(index=family_rows(frame).index)


def split_skipped(rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the rows of checks that ran, the `skip` rows)."""
    skipped = rows["verdict"] == SKIP
    return rows[~skipped], rows[skipped]


def skip_reasons(skipped: pd.DataFrame) -> list[tuple[str, int]]:
    """(reason, how many rows) per distinct reason, most frequent first (then as first written)."""
    reasons = skipped["detail"].replace("", "no reason recorded")
    counts = reasons.value_counts(sort=False)
    first = {reason: i for i, reason in enumerate(dict.fromkeys(reasons))}
    return sorted(((str(r), int(n)) for r, n in counts.items()), key=lambda item: (-item[1], first[item[0]]))


def skip_lines(skipped: pd.DataFrame, *, nothing_ran: bool) -> list[str]:
    """One line per distinct skip reason with its count; `nothing_ran`: the suite only skipped."""
    lead = "nothing ran: " if nothing_ran else ""
    return [f"{lead}{n} {'test' if n == 1 else 'tests'} skipped: {reason}" for reason, n in skip_reasons(skipped)]


def not_provided(frame: pd.DataFrame) -> list[dict[str, str]]:
    """One line per family the target does not provide (its `family_not_provided` rows), naming the
    missing members (the row's `data`) and the suites not run; [] when every family ran."""
    lines = []
    for family, group in family_rows(frame).groupby("case", sort=False):
        reason = next((d for d in group["detail"] if d), "")
        data = next((found for cell in group["data"] if (found := row_data(cell))), {})
        suites = list(dict.fromkeys(group["suite"]))
        tests = pd.to_numeric(group["value"], errors="coerce").dropna()
        count = f" ({int(tests.sum())} tests)" if not tests.empty else ""
        not_run = f"{'suite' if len(suites) == 1 else 'suites'} {', '.join(suites)} not run{count}"
        if data.get("missing"):  # a model family the target does not provide
            name = str(data.get("what") or family)
            text = f"{name[:1].upper()}{name[1:]}: not provided by this target (no {', '.join(data['missing'])}): {not_run}"
        else:  # a suite that does not apply to this target (the mutant catalogue)
            text = f"{family}: {not_run}: {reason}"
        lines.append({"text": text, "reason": reason})
    return lines


# ---------------------------------------------------------------------------------------------
# Summary: what failed
# ---------------------------------------------------------------------------------------------


def _suite_class(row: pd.Series) -> str:
    return "error" if row["error"] else ("fail" if row["fail"] else ("tie_flip" if row["tie_flip"] else "pass"))


def summary_section(review: Review) -> dict[str, Any]:
    frame = listed(review.frame)
    summary = summarize(frame)
    if summary.empty:
        return {"empty": True}
    summary = failing_suites_first(summary)
    columns: tuple[str, ...] = ("suite", "cases", "pass", "fail", "tie_flip", "error", "not_applicable", "skip", "worst")
    failing = review.failing
    data: dict[str, Any] = {
        "empty": False,
        "summary": table(summary, columns, row_class=_suite_class, table_id="summary-table"),
        # one line per failing case, each rule once (parity.report.case_lines)
        "case_lines": case_lines.page_lines(review.frame, review.run_dir) if not failing.empty else [],
        "failing": None,
        "flips": None,
        "skipped": None,
        "not_applicable": None,
    }
    if not failing.empty:
        columns = ("verdict", "suite", "case", "mode", "site", "metric", "value", "threshold", "better", "detail")
        data["failing"] = table(case_lines.without_rules(failing), columns, table_id="failing-rows")
    flips = review.frame[(review.frame["kind"] != "info") & (review.frame["verdict"] == TIE_FLIP)]
    if not flips.empty:
        columns = ("verdict", "suite", "case", "mode", "site", "metric", "value", "threshold", "detail")
        data["flips"] = (len(flips), table(flips, columns))
    skipped = frame[frame["verdict"] == SKIP]
    if not skipped.empty:
        grouped = pd.DataFrame(
            [
                {"suite": suite, "tests": n, "reason": reason}
                for suite in dict.fromkeys(skipped["suite"])
                for reason, n in skip_reasons(skipped[skipped["suite"] == suite])
            ]
        )
        data["skipped"] = (
            len(skipped),
            table(grouped, ("suite", "tests", "reason"), row_class=lambda _: SKIP, table_id="skipped-rows"),
        )
    not_applicable = frame[(frame["verdict"] == NOT_APPLICABLE) & (frame["kind"] != "info")]
    if not not_applicable.empty:
        columns = ("verdict", "suite", "case", "mode", "metric", "detail")
        data["not_applicable"] = (len(not_applicable), table(not_applicable, columns, table_id="not-applicable-rows"))
    return data


# ---------------------------------------------------------------------------------------------
# Against the baseline
# ---------------------------------------------------------------------------------------------


def baseline_section(review: Review) -> dict[str, Any]:
    comparison = review.comparison
    if comparison is None:
        return {"note": review.baseline_note or "not compared with a baseline (run `parity review RUN_DIR` to compare)"}

    def outcomes(frame: pd.DataFrame, kind: str, table_id: str = "") -> Table | None:
        return table(frame, OUTCOME_COLUMNS, row_class=lambda _: kind, table_id=table_id) if not frame.empty else None

    def cases(frame: pd.DataFrame, kind: str) -> Table | None:
        columns = ("suite", "case", "target", "mode", "rows", "gate_rows")
        return table(frame, columns, row_class=lambda _: kind) if not frame.empty else None

    return {
        "note": "",
        "comparison": comparison,
        "not_compared": [f"not compared ({count} baseline rows): {why}" for why, count in comparison.not_compared.items()],
        "outcomes": [
            ("Regressions", len(comparison.regressions), outcomes(comparison.regressions, "regression", "regressions")),
            ("Improvements", len(comparison.improvements), outcomes(comparison.improvements, "improvement", "improvements")),
        ],
        "cases": [
            ("New cases", len(new := comparison.new_cases()), cases(new, "new")),
            (
                "Vanished cases (a vanished gate row fails the review)",
                len(vanished := comparison.vanished_cases()),
                cases(vanished, "regression"),
            ),
        ],
        "changed": (len(comparison.changed), outcomes(comparison.changed, "")),
        "moves": (len(comparison.info_moves), len(comparison.large_info_moves()), outcomes(comparison.info_moves, "")),
        "info_factor": f"{INFO_LIST_FACTOR:g}",
    }


# ---------------------------------------------------------------------------------------------
# Where it diverges: the stage chains of the failing cases (parity.report.chains)
# ---------------------------------------------------------------------------------------------


def _repro(review: Review, relative: str) -> dict[str, str] | None:
    """The repro the blame row names: linked only when it is a file inside the run directory."""
    if not relative:
        return None
    path = repro_file(review.run_dir, relative)
    if path is None:
        return {"missing": relative}
    return {"missing": "", "path": path.relative_to(review.run_dir).as_posix(), "href": href(path.relative_to(review.run_dir))}


def _chain(review: Review, found: Localised, chain: StageChain, chain_index: int, n: int, assets: Assets) -> dict[str, Any]:
    """One chain: the blamed stage, the summary, the repro, the stage table and the plot."""
    data: dict[str, Any] = {
        "heading": f"Localisation {n + 1} of {len(found.chains)}" if len(found.chains) > 1 else "",
        "blamed": chain.blamed,
        "summary": chain.summary,
        "repro": _repro(review, chain.repro),
        "empty": chain.stages.empty,
    }
    if chain.stages.empty:
        return data
    lines, folded = chain_lines(chain)
    data["folded"] = ""
    if folded:
        opened = f"every stage of the layer holding {chain.focus()}, " if chain.focus() else ""
        data["folded"] = (
            f"{len(chain.stages)} stages: {opened}every stage outside the layers, and the other {folded} layers one line "
            f"each (how many stages diverged, the worst against its bound); every stage is a row of {RESULTS_FILE}"
        )
    data["table"] = table(lines, LINE_COLUMNS, row_class=lambda row: row["_class"], table_id=f"stages-{chain_index}")
    where = f"{found.suite} / {found.case} / {found.mode}"
    stages = chain.stages
    drawn = stage_chain_plot(
        stages["site"].tolist(),
        stages["value"].tolist(),
        stages["threshold"].tolist(),
        assets.path(f"stages-{found.suite}-{found.case}-{found.mode}"),
        f"{where}: error against its bound, stage by stage",
        chain.blamed,
    )
    data["figure"] = None
    if drawn is not None:
        path, caption = drawn
        text = f"{where}: each stage's value / bound in execution order, log scale; dashed line: the bound"
        data["figure"] = assets.figure(path, f"{where}: stage chain", text + (f"; {caption}" if caption else ""))
    return data


def localise_section(review: Review, assets: Assets) -> dict[str, Any] | None:
    """Where each localised case diverges; None when no case was localised (no section, no link)."""
    cases = localised_cases(review.frame)
    if not cases:
        return None
    shown, chain_index = [], 0
    for k, found in enumerate(cases[:MAX_LOCALISED]):
        rows = review.frame
        mine = rows[(rows["suite"] == found.suite) & (rows["case"] == found.case) & (rows["mode"] == found.mode)]
        chains = []
        for n, chain in enumerate(found.chains):
            chains.append(_chain(review, found, chain, chain_index, n, assets))
            chain_index += 1
        pieces = [{"site": str(piece["site"]), "detail": str(piece["detail"])} for _, piece in found.pieces.iterrows()]
        where = f"{found.suite} / {found.case} / {found.mode}"
        shown.append({"k": k, "where": where, "verdict": gate_verdict(mine), "pieces": pieces, "chains": chains})
    rest = cases[MAX_LOCALISED:]
    more = None
    if rest:
        frame = pd.DataFrame(
            [
                {
                    "suite": found.suite,
                    "case": found.case,
                    "mode": found.mode,
                    "first_diverging_stage": ", ".join(c.blamed for c in found.chains if c.blamed),
                    "repro": ", ".join(c.repro for c in found.chains if c.repro),
                    "detail": " | ".join(c.summary for c in found.chains),
                }
                for found in rest
            ]
        )
        more = (len(rest), table(frame, frame.columns.tolist(), row_class=lambda _: FAIL, table_id="localised-more"))
    return {"anchor": LOCALISE_ANCHOR, "cases": shown, "more": more}


# ---------------------------------------------------------------------------------------------
# All rows, the environment
# ---------------------------------------------------------------------------------------------


def all_rows_section(review: Review) -> dict[str, Any]:
    frame = listed(review.frame)
    suites = []
    for suite in suites_in(frame):
        rows = frame[frame["suite"] == suite]
        verdict = gate_verdict(rows)
        ran, skipped = split_skipped(rows)
        suites.append(
            {
                "suite": suite,
                "open": verdict in (FAIL, ERROR),
                "counted": f"{len(ran)} rows" + (f", {len(skipped)} skipped" if not skipped.empty else ""),
                "verdict": verdict,
                "skip_lines": skip_lines(skipped, nothing_ran=ran.empty) if not skipped.empty else [],
                "table": table(failing_first(ran), ROW_COLUMNS) if not ran.empty else None,
            }
        )
    return {"empty": frame.empty, "suites": suites}


def _env_text(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def environment_section(review: Review) -> dict[str, Any]:
    info = dict(review.info)
    frame = review.frame
    for column in ("torch_version", "git_sha", "device", "dtype", "size", "target"):
        values = sorted(set(frame[column]) - {""}) if column in frame else []
        if values:
            info.setdefault(f"rows: {column}", ", ".join(values))
    if not info:
        return {"table": None}
    first = ("torch", "device", "device_name", "cuda", "git_sha", "dtype", "size", "target", "run_id")
    keys = [k for k in first if k in info] + sorted(k for k in info if k not in first)
    items = pd.DataFrame([{"key": k, "value": _env_text(info[k])} for k in keys])
    return {
        "table": table(items, ("key", "value"), row_class=lambda _: "", table_id="environment"),
        "linked": (review.run_dir / RUN_INFO_FILE).is_file(),
    }

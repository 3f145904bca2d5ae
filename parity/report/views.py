"""The review page's suite views as data: a section that reads one suite's rows, drawn only when
that suite has rows that ran (templates/views/*.html.j2 draw them).

In reading order: where numerics diverged, where decoding diverged (`decode_view`), what
recompiled and why, what the images look like, the routing audit, which mutants were caught, and
with `--mutants` the target's own score. Any other suite is still listed in the summary, the
navigation and "All rows by suite" (its rows come from the data), so a new suite needs no view.
A view knows its metrics by the metrics table's names (`parity.compare.metrics`), in its order.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from parity.compare import ERROR, FAIL, PASS, TIE_FLIP
from parity.compare.metrics import METRICS
from parity.report.decode_view import decode_view
from parity.report.html import Assets, Figure, fmt_number, gate_verdict, href, table, worst_verdict
from parity.report.mutation import mutation_score
from parity.report.plots import (
    OTHER_SITES,
    SITE_FAMILIES,
    SiteFamily,
    divergence_plot,
    image_diff_plot,
    load_png,
    site_family,
    site_order,
)
from parity.report.review import Review, failing_first, used_share
from parity.report.run_info import target_name
from parity.report.sections import ROW_COLUMNS, skip_lines, split_skipped, suites_in

IMAGES_DIR = "images"  # PNGs a suite writes: images/<case>/<variant>.png
VARIANT_ORDER = ("reference", "serving_eager", "serving_compiled")
# The metrics a view shows, in the metrics table's order (tests/repo/test_metrics.py holds them to it).
NUMERICS_PLOTTED = ("max_abs", "rel_l2")
IMAGE_METRICS = ("psnr", "ssim")
LEDGER_METRICS = ("compiles", "new_compiles", "recompiles")  # bare, or per code object: `compiles[Block.forward]`
ROUTING_METRICS = ("ids_mismatch", "weight_max_abs")


def _view_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """A summary frame shown as rows: gate rows without a number, so `failing_first` orders them by verdict."""
    return failing_first(frame.assign(kind="gate", value=math.nan, threshold=math.nan, better="")) if not frame.empty else frame


# ---------------------------------------------------------------------------------------------
# Numerics
# ---------------------------------------------------------------------------------------------


def _first_divergence(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (case, mode): its verdict, the first failing site in forward order, the site nearest its bound."""
    out = []
    for (case, mode), group in rows.groupby(["case", "mode"], sort=False):
        gates = group[group["kind"] != "info"]
        order = {site: i for i, site in enumerate(site_order(group["site"].tolist()))}
        gates = gates.assign(_x=gates["site"].map(order).fillna(len(order)))
        failing = gates[gates["verdict"].isin((FAIL, ERROR))].sort_values("_x", kind="stable")
        first = failing.iloc[0] if not failing.empty else None
        used = gates.apply(used_share, axis=1) if not gates.empty else pd.Series(dtype=float)
        nearest = gates.loc[used.idxmax()] if not used.empty and used.max() != -math.inf else None
        out.append(
            {
                "case": case,
                "mode": mode,
                "verdict": gate_verdict(group),
                "first_failing_site": (first["site"] or "(whole output)") if first is not None else "none",
                "at_first_failure": f"{first['metric']}={fmt_number(first['value'])} > {fmt_number(first['threshold'])}"
                if first is not None
                else "",
                "nearest_to_bound": (
                    f"{nearest['site'] or '(whole output)'}: {nearest['metric']}={fmt_number(nearest['value'])}, "
                    f"{used.max():.1%} of bound {fmt_number(nearest['threshold'])}"
                )
                if nearest is not None
                else "",
            }
        )
    frame = pd.DataFrame(out, columns=["case", "mode", "verdict", "first_failing_site", "at_first_failure", "nearest_to_bound"])
    return _view_rows(frame)


def numerics_view(review: Review, rows: pd.DataFrame, assets: Assets) -> dict[str, Any]:
    columns = ("case", "mode", "verdict", "first_failing_site", "at_first_failure", "nearest_to_bound")
    sited = rows[rows["site"] != ""]
    families: dict[SiteFamily, list[str]] = {}
    for site in site_order(sited["site"].tolist()):
        families.setdefault(site_family(site), []).append(site)
    plots: list[tuple[Figure | None, str]] = []  # (figure, or the note saying why there is none)
    names = " / ".join(NUMERICS_PLOTTED)
    for family in (*SITE_FAMILIES, OTHER_SITES):
        if family not in families:
            continue
        family_rows = sited[sited["site"].isin(families[family])]
        drawn = divergence_plot(family_rows, NUMERICS_PLOTTED, assets.path(f"numerics-{family.key}"), family.title)
        if drawn is None:
            plots.append((None, f"{family.title}: no finite {names} values to plot"))
            continue
        path, caption = drawn
        text = (
            f"{family.title}: {' and '.join(NUMERICS_PLOTTED)} by site, one line per (case, mode), log scale; "
            "dashed line = the gate's bound"
        )
        plots.append((assets.figure(path, family.title, text + (f"; {caption}" if caption else "")), ""))
    return {
        "divergence": table(_first_divergence(rows), columns, table_id="numerics-divergence"),
        "sited": bool(families),
        "plots": plots,
    }


# ---------------------------------------------------------------------------------------------
# Recompiles
# ---------------------------------------------------------------------------------------------

_LABELLED_METRIC = re.compile(r"^(?P<base>[a-z_]+)\[(?P<code>.*)\]$")


def split_metric(metric: str) -> tuple[str, str]:
    """(`compiles`, `TransformerBlock.forward`) for `compiles[TransformerBlock.forward]`; (metric, '') otherwise."""
    match = _LABELLED_METRIC.match(metric)
    return (match["base"], match["code"]) if match else (metric, "")


def _first_bound(*rows: pd.Series | None) -> float:
    for row in rows:
        if row is not None and not pd.isna(row["threshold"]):
            return float(row["threshold"])
    return math.nan


def _ledger(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (shape, mode, code object) in lattice order: compiles, new compiles, bound, reasons."""
    lines = []
    for (case, mode, code), group in rows.groupby(["case", "mode", "_code"], sort=False):
        last = {m: (group[group["_base"] == m].iloc[-1] if (group["_base"] == m).any() else None) for m in LEDGER_METRICS}
        lines.append(
            {
                "shape": case,
                "mode": mode,
                "code": code,
                **{m: (row["value"] if (row := last[m]) is not None else math.nan) for m in LEDGER_METRICS},
                "bound": _first_bound(last["new_compiles"], last["compiles"]),
                "verdict": gate_verdict(group),
                "reason": " | ".join(dict.fromkeys(d for d in group["detail"] if d)),
            }
        )
    return pd.DataFrame(lines)


def recompiles_view(review: Review, rows: pd.DataFrame, assets: Assets) -> dict[str, Any]:
    parts = rows["metric"].map(split_metric)
    rows = rows.assign(_base=parts.str[0], _code=parts.str[1])
    in_ledger = rows["_base"].isin(LEDGER_METRICS)
    data: dict[str, Any] = {"ledger": None, "other": None}
    if in_ledger.any():
        ledger = _ledger(rows[in_ledger])
        columns = ["shape", "mode", "code", *LEDGER_METRICS, "bound", "verdict", "reason"]
        for optional in ("code", "new_compiles", "recompiles"):
            if ledger[optional].replace("", math.nan).isna().all():
                columns.remove(optional)
        data["ledger"] = table(ledger, columns, table_id="recompile-ledger")
    other = failing_first(rows[~in_ledger].drop(columns=["_base", "_code"]))
    if not other.empty:
        data["other"] = table(other, ROW_COLUMNS)
    return data


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def _variant_key(name: str) -> tuple[int, str]:
    return (VARIANT_ORDER.index(name) if name in VARIANT_ORDER else len(VARIANT_ORDER), name)


def image_cases(run_dir: Path) -> dict[str, list[Path]]:
    """`images/<case>/<variant>.png` under the run directory, variants in reference-first order."""
    root = run_dir / IMAGES_DIR
    if not root.is_dir():
        return {}
    cases = {}
    for case_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        pngs = sorted(case_dir.glob("*.png"), key=lambda p: _variant_key(p.stem))
        if pngs:
            cases[case_dir.name] = pngs
    return cases


def _image_scores(rows: pd.DataFrame) -> pd.DataFrame:
    scores = []
    for (case, mode), group in rows.groupby(["case", "mode"], sort=False):
        entry = {"case": case, "pair": mode, "verdict": gate_verdict(group)}
        for metric in IMAGE_METRICS:
            mine = group[group["metric"] == metric]
            entry[metric] = mine["value"].iloc[-1] if not mine.empty else math.nan
            entry[f"{metric}_bound"] = mine["threshold"].iloc[-1] if not mine.empty else math.nan
        entry["detail"] = " | ".join(dict.fromkeys(d for d in group["detail"] if d))
        scores.append(entry)
    return _view_rows(pd.DataFrame(scores))


def images_view(review: Review, rows: pd.DataFrame, assets: Assets) -> dict[str, Any]:
    psnr = METRICS["psnr"]
    cases = []
    for case, pngs in image_cases(review.run_dir).items():
        shown = []
        for png in pngs:
            link = href(png.relative_to(review.run_dir).as_posix())
            shown.append(Figure(link, f"{case}: {png.stem}", png.stem, link=link, width=256))
        images = {png.stem: load_png(png) for png in pngs}
        reference = "reference" if "reference" in images else pngs[0].stem
        drawn = image_diff_plot(images, reference, assets.path(f"image-diff-{case}"), f"{case}: difference against {reference}")
        heat, note = None, ""
        if drawn is not None:
            path, panels = drawn
            text = "; ".join(f"{p.candidate}: max {p.max_diff}/255, mean {p.mean_diff:.3g}" for p in panels)
            heat = assets.figure(path, f"{case}: difference heat map", text)
        elif len(images) > 1:
            note = "variants differ in size: no heat map"
        cases.append({"case": case, "images": shown, "heat": heat, "note": note})
    columns = ("case", "pair", "verdict", *(f"{m}{suffix}" for m in IMAGE_METRICS for suffix in ("", "_bound")), "detail")
    return {
        "title": f"PSNR / SSIM by case (PSNR in {psnr.unit}, {psnr.better} is better; data_range in the detail)",
        "scores": table(_image_scores(rows), columns, table_id="image-scores"),
        "images_dir": IMAGES_DIR,
        "cases": cases,
    }


# ---------------------------------------------------------------------------------------------
# Routing, the mutant catalogues
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _GridPoint:
    """One routing grid point's rows, gathered in one pass (a routing run has hundreds of points:
    filtering the frame once per point took 7 s of a review)."""

    gate_verdicts: list[str] = dataclasses.field(default_factory=list)
    all_verdicts: list[str] = dataclasses.field(default_factory=list)
    values: dict[str, float] = dataclasses.field(default_factory=dict)
    flip_sites: dict[str, None] = dataclasses.field(default_factory=dict)
    details: dict[str, None] = dataclasses.field(default_factory=dict)

    def add(self, row: Any) -> None:
        self.all_verdicts.append(row.verdict)
        if row.kind != "info":
            self.gate_verdicts.append(row.verdict)
        if row.metric in ROUTING_METRICS and not pd.isna(row.value):
            self.values[row.metric] = max(self.values.get(row.metric, -math.inf), float(row.value))
        if row.verdict == TIE_FLIP and row.site:
            self.flip_sites[row.site] = None
        if row.verdict in (FAIL, ERROR, TIE_FLIP) and row.detail:
            self.details[row.detail] = None

    def entry(self, case: str, mode: str) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "grid_point": case,
            "mode": mode,
            "verdict": worst_verdict(self.gate_verdicts or self.all_verdicts),
        }
        entry.update({metric: self.values.get(metric, math.nan) for metric in ROUTING_METRICS})
        entry["tie_flip_rows"] = ", ".join(self.flip_sites)
        entry["detail"] = " | ".join(self.details)
        return entry


def routing_view(review: Review, rows: pd.DataFrame, assets: Assets) -> dict[str, Any]:
    points: dict[tuple[str, str], _GridPoint] = {}
    for row in rows.itertuples(index=False):
        points.setdefault((row.case, row.mode), _GridPoint()).add(row)
    frame = _view_rows(pd.DataFrame([point.entry(case, mode) for (case, mode), point in points.items()]))
    counts = frame["verdict"].value_counts()
    columns = ("grid_point", "mode", "verdict", *ROUTING_METRICS, "tie_flip_rows", "detail")
    return {
        "points": len(frame),
        "failing": int(counts.get(FAIL, 0) + counts.get(ERROR, 0)),
        "flips": int(counts.get(TIE_FLIP, 0)),
        "passing": int(counts.get(PASS, 0)),
        "table": table(frame, columns, table_id="routing-audit"),
    }


def sensitivity_view(review: Review, rows: pd.DataFrame, assets: Assets) -> dict[str, Any]:
    killed = rows[rows["metric"] == "killed"]
    shown = failing_first(killed if not killed.empty else rows).rename(columns={"case": "mutant", "mode": "target_suite"})
    score = mutation_score(rows)
    columns = ("verdict", "mutant", "target_suite", "metric", "value", "detail")
    return {
        "headline": score.line() if score is not None else "no mutant rows",
        "table": table(shown, columns, table_id="sensitivity-table"),
    }


def target_mutants_view(review: Review, rows: pd.DataFrame, assets: Assets) -> dict[str, Any]:
    """The planted catalogue: each mutant planted in this run's target, its surface, who had to kill it."""
    killed = rows[rows["metric"] == "killed"]
    shown = failing_first(killed if not killed.empty else rows).rename(
        columns={"case": "mutant", "mode": "target_suite", "site": "surface"}
    )
    score = mutation_score(rows, planted_on=target_name(review.info))
    columns = ("verdict", "mutant", "surface", "target_suite", "metric", "detail")
    return {
        "headline": score.line() if score is not None else "no mutant rows",
        "table": table(shown, columns, table_id="target-mutants-table"),
    }


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SuiteView:
    """A section that reads one suite's rows; drawn only when that suite has rows in the run."""

    suite: str
    anchor: str
    title: str
    nav: str
    data: Callable[[Review, pd.DataFrame, Assets], dict[str, Any]]
    template: str  # under templates/views/


# The metrics each view reads by name (each a metrics table name: tests/repo/test_metrics.py).
VIEW_METRICS = {
    "numerics": NUMERICS_PLOTTED,
    "recompiles": LEDGER_METRICS,
    "image": IMAGE_METRICS,
    "routing": ROUTING_METRICS,
    "sensitivity": ("killed",),
    "target_mutants": ("killed",),
    "decode": ("matched_steps", "tokens", "step_max_abs"),
}

SUITE_VIEWS = (
    SuiteView("numerics", "numerics", "Numerics: where it diverged", "Numerics", numerics_view, "numerics.html.j2"),
    SuiteView("decode", "decode", "Decode: where generation diverged", "Decode", decode_view, "decode.html.j2"),
    SuiteView(
        "recompiles", "recompiles", "Recompiles: what recompiled and why", "Recompiles", recompiles_view, "recompiles.html.j2"
    ),
    SuiteView("image", "images", "Images", "Images", images_view, "images.html.j2"),
    SuiteView("routing", "routing", "Routing audit", "Routing", routing_view, "routing.html.j2"),
    SuiteView(
        "sensitivity",
        "sensitivity",
        "Sensitivity (mutants each suite must catch)",
        "Sensitivity",
        sensitivity_view,
        "sensitivity.html.j2",
    ),
    SuiteView(
        "target_mutants",
        "target-mutants",
        "Your target's score (mutants planted in it)",
        "Target mutants",
        target_mutants_view,
        "target_mutants.html.j2",
    ),
)


def suite_views(review: Review, assets: Assets, frame: pd.DataFrame) -> list[tuple[SuiteView, dict[str, Any]]]:
    """(view, its data) for every view whose suite has rows in `frame` (the rows the views read),
    in reading order. A view reads only the rows that ran; its skipped tests are one line per
    reason, and a suite that only skipped is those lines."""
    present = set(suites_in(frame))
    out = []
    for view in SUITE_VIEWS:
        if view.suite in present:
            ran, skipped = split_skipped(frame[frame["suite"] == view.suite])
            out.append(
                (
                    view,
                    {
                        "skip_lines": skip_lines(skipped, nothing_ran=ran.empty) if not skipped.empty else [],
                        "data": view.data(review, ran, assets) if not ran.empty else None,
                    },
                )
            )
    return out

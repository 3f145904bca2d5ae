"""The review page's figures: error by layer (numerics), error by step (decode), difference heat
maps (images) and a failing case's stage chain (error against its bound, stage by stage).

Figures are drawn with matplotlib's object API on an Agg canvas, never through pyplot, so writing a
page neither needs a display nor changes the backend of a process that imported the harness.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from parity.target import FAMILIES

_INDEXED_SITE = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)$")
# Sites that close a model's forward pass: drawn after its layers / blocks.
_FINAL_SITES = ("logits", "velocity")


@dataclasses.dataclass(frozen=True)
class SiteFamily:
    """A group of sites drawn on one x axis (the AR decoder's layers, the DiT's blocks)."""

    key: str
    title: str
    sites: tuple[str, ...] = ()  # "layer." a prefix, "logits" a name (`parity.target.Family.sites`)


# The model families' per-site plots, in the order of `FAMILIES`.
SITE_FAMILIES = tuple(SiteFamily(f.key, f.plot_title, f.sites) for f in FAMILIES.values() if f.sites)
OTHER_SITES = SiteFamily("other", "other sites")


def site_family(site: str) -> SiteFamily:
    for family in SITE_FAMILIES:
        if any(site.startswith(s) if s.endswith(".") else site == s for s in family.sites):
            return family
    return OTHER_SITES


def site_order(sites: Sequence[str]) -> list[str]:
    """Forward order of a family's sites: `layer.N` by N; named blocks in the order rows were
    written (suites write in forward order); `logits` / `velocity` last."""
    unique = list(dict.fromkeys(s for s in sites if s))
    indexed = [s for s in unique if (match := _INDEXED_SITE.match(s)) and match["prefix"] == "layer"]
    final = [s for s in unique if s in _FINAL_SITES]
    named = [s for s in unique if s not in indexed and s not in final]
    indexed.sort(key=lambda s: int(s.rsplit(".", 1)[1]))  # `layer.N`, matched above
    return indexed + named + final


def _save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    figure.savefig(path, format="png", dpi=96)
    return path


def divergence_plot(rows: pd.DataFrame, metrics: Sequence[str], path: Path, title: str) -> tuple[Path, str] | None:
    """Error by site, one line per (case, mode), one panel per metric, log scale.

    `rows` are numerics rows of one site family. Returns the PNG path and a caption (what was drawn
    at the floor), or None when no metric has a finite value to draw.
    """
    order = site_order(rows["site"].tolist())
    position = {site: i for i, site in enumerate(order)}
    panels = [m for m in metrics if np.isfinite(rows.loc[rows["metric"] == m, "value"]).any()]
    if not order or not panels:
        return None
    values = rows.loc[rows["metric"].isin(panels), "value"]
    finite = values[np.isfinite(values)]
    positive = finite[finite > 0]
    floor = float(positive.min()) / 10 if not positive.empty else 1e-12
    width = max(6.0, min(16.0, 0.35 * len(order) + 4)) * len(panels)
    figure = Figure(figsize=(width, 4.2), layout="constrained")
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    lines = list(rows[["case", "mode"]].drop_duplicates().itertuples(index=False))
    palette = "tab10" if len(lines) <= 10 else "tab20"  # tab20 pairs similar hues; only when needed
    colours = matplotlib.colormaps[palette].resampled(max(len(lines), 1))
    markers = "os^vD<>ph*"
    zero_drawn = False
    for axis, metric in zip(axes, panels):
        for i, (case, mode) in enumerate(lines):
            mine = rows[(rows["case"] == case) & (rows["mode"] == mode) & (rows["metric"] == metric)]
            mine = mine[mine["site"].isin(position)]
            if mine.empty:
                continue
            mine = mine.assign(_x=mine["site"].map(position)).sort_values("_x")
            y = mine["value"].to_numpy(dtype=float)
            zero_drawn |= bool((y <= 0).any())
            y = np.where(np.isfinite(y), np.maximum(y, floor), np.nan)
            axis.plot(
                mine["_x"],
                y,
                marker=markers[i % len(markers)],
                markersize=4,
                linewidth=1.2,
                color=colours(i),
                label=f"{case} / {mode}",
            )
        thresholds = rows.loc[(rows["metric"] == metric) & (rows["kind"] != "info"), "threshold"].dropna().unique()
        if len(thresholds) == 1 and thresholds[0] > 0:
            axis.axhline(thresholds[0], color="crimson", linestyle="--", linewidth=1, label=f"bound {thresholds[0]:.3g}")
        axis.set_yscale("log")
        axis.set_title(metric)
        axis.set_xticks(range(len(order)))
        step = max(1, len(order) // 24)
        axis.set_xticklabels([s if i % step == 0 else "" for i, s in enumerate(order)], rotation=60, ha="right", fontsize=7)
        axis.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        figure.legend(handles, labels, loc="outside right upper", fontsize=7)
    figure.suptitle(title)
    caption = f"exact zeros are drawn at {floor:.3g} (log scale)" if zero_drawn else ""
    return _save(figure, path), caption


def decode_step_plot(
    series: Sequence[tuple[str, Sequence[float]]], path: Path, title: str, diverged_at: int | None = None
) -> tuple[Path, str] | None:
    """Step logits' error by decode step for one case: one line per (label, per-step values), log
    scale, a dotted vertical line at the step where the tokens diverged. Returns the PNG path and a
    caption (what was drawn at the floor), or None when no value is finite."""
    drawn = [(label, np.asarray(values, dtype=float)) for label, values in series if len(values)]
    finite = np.concatenate([v[np.isfinite(v)] for _, v in drawn]) if drawn else np.array([])
    if finite.size == 0:
        return None
    positive = finite[finite > 0]
    floor = float(positive.min()) / 10 if positive.size else 1e-12
    figure = Figure(figsize=(6.4, 3.0), layout="constrained")
    axis = figure.subplots()
    zero_drawn = False
    for i, (label, values) in enumerate(drawn):
        zero_drawn |= bool((values <= 0).any())
        y = np.where(np.isfinite(values), np.maximum(values, floor), np.nan)
        axis.plot(np.arange(len(y)), y, marker="os^vD"[i % 5], markersize=3, linewidth=1.1, label=label)
    if diverged_at is not None:
        axis.axvline(diverged_at, color="crimson", linestyle=":", linewidth=1.2, label=f"tokens diverge at step {diverged_at}")
    axis.set_yscale("log")
    axis.set_xlabel("decode step")
    axis.set_ylabel("max |target - reference|")
    axis.grid(True, which="major", alpha=0.3)
    axis.legend(fontsize=7)
    axis.set_title(title, fontsize=9)
    caption = f"exact zeros are drawn at {floor:.3g} (log scale)" if zero_drawn else ""
    return _save(figure, path), caption


def _plain(text: str) -> str:
    """Text from the rows drawn as written: a `$` would start matplotlib's mathtext (and can fail to parse)."""
    return text.replace("$", r"\$")


_STAGE_GROUP = re.compile(r"^(?P<group>[A-Za-z_]+\.\d+)\.")
MAX_STAGE_LABELS = 24  # layer names on a stage chain plot beyond which every n-th is named


def stage_chain_plot(
    sites: Sequence[str], values: Sequence[float], bounds: Sequence[float], path: Path, title: str, blamed: str = ""
) -> tuple[Path, str] | None:
    """A failing case's stages in execution order, each one's value / bound, log scale: the bound
    is the dashed line at 1, a stage that diverged is red, the blamed one a star named beside it.

    An exact stage (bound 0) is drawn at the floor when it matches and at the top (x) when it does
    not; a stage not judged (value NaN) leaves a grey tick on the axis. Layers are labelled at
    their first stage. Returns the PNG path and a caption, or None when no stage was judged."""
    value, bound = np.asarray(values, dtype=float), np.asarray(bounds, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(bound > 0, value / bound, np.where(value == 0, 0.0, np.inf))
    share = np.where(np.isnan(value) | np.isnan(bound), np.nan, share)
    judged = ~np.isnan(share)
    if not judged.any():
        return None
    finite = share[np.isfinite(share)]
    positive = finite[finite > 0]
    floor = float(positive.min()) / 10 if positive.size else 1e-3
    floor = min(floor, 0.1)
    ceiling = max(float(finite.max()) * 10 if finite.size else 10.0, 10.0)
    x = np.arange(len(share))
    shown = np.clip(np.where(np.isinf(share), ceiling, share), floor, ceiling)
    diverged = judged & (share > 1)
    figure = Figure(figsize=(max(7.5, min(16.0, 0.03 * len(share) + 6)), 3.8), layout="constrained")
    axis = figure.subplots()
    groups = [m["group"] if (m := _STAGE_GROUP.match(s)) else "" for s in sites]
    starts = [i for i, g in enumerate(groups) if g and (i == 0 or groups[i - 1] != g)]
    for i in starts:
        axis.axvline(i - 0.5, color="0.85", linewidth=0.8, zorder=0)
    axis.plot(x[judged], shown[judged], color="0.6", linewidth=0.8, zorder=1)
    exact_miss = judged & np.isinf(share)
    for mask, colour, label, marker in (
        (judged & ~diverged, "tab:blue", "within bound", "o"),
        (diverged & ~exact_miss, "tab:red", "diverged", "o"),
        (exact_miss, "tab:red", "exact stage differs (drawn at the top)", "x"),
    ):
        if mask.any():
            axis.plot(x[mask], shown[mask], linestyle="none", marker=marker, markersize=3.5, color=colour, label=label, zorder=2)
    if (~judged).any():
        axis.plot(
            x[~judged],
            np.full(int((~judged).sum()), floor),
            linestyle="none",
            marker="|",
            markersize=8,
            color="0.55",
            label="not judged",
            zorder=2,
        )
    if blamed in sites:
        at = list(sites).index(blamed)
        if judged[at]:
            axis.plot(
                [at],
                [shown[at]],
                linestyle="none",
                marker="*",
                markersize=14,
                color="crimson",
                markeredgecolor="black",
                label=f"blamed: {_plain(blamed)}",
                zorder=3,
            )
            axis.annotate(_plain(blamed), (at, shown[at]), textcoords="offset points", xytext=(6, 6), fontsize=8, color="crimson")
    axis.axhline(1.0, color="crimson", linestyle="--", linewidth=1, label="bound (value = bound)")
    axis.set_yscale("log")
    axis.set_ylim(floor / 2, ceiling * 2)
    axis.set_xlim(-0.5, len(share) - 0.5)
    axis.set_xlabel("stage, in execution order")
    axis.set_ylabel("value / bound")
    # Stages outside the layers (and the blamed one) are ticks; each layer is named once, at its first stage.
    ticks = {i: site for i, (site, group) in enumerate(zip(sites, groups)) if not group or site == blamed}
    axis.set_xticks(list(ticks))
    axis.set_xticklabels([_plain(label) for label in ticks.values()], rotation=60, ha="right", fontsize=7)
    step = max(1, -(-len(starts) // MAX_STAGE_LABELS))
    for n, i in enumerate(starts):
        if n % step == 0:
            axis.text(i, 1.01, _plain(groups[i]), transform=axis.get_xaxis_transform(), fontsize=7, color="0.35", rotation=45)
    axis.grid(True, which="major", axis="y", alpha=0.3)
    figure.legend(*axis.get_legend_handles_labels(), loc="outside right upper", fontsize=7)
    figure.suptitle(_plain(title), fontsize=9)
    notes = []
    if positive.size < finite.size:
        notes.append(f"stages exactly at the golden are drawn at {floor:.3g}")
    if exact_miss.any():
        notes.append(f"exact stages that differ are drawn at {ceiling:.3g}")
    return _save(figure, path), "; ".join(notes)


def load_png(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


@dataclasses.dataclass(frozen=True)
class DiffPanel:
    """One heat map: |candidate - reference| per pixel, the largest over channels, in 0..255 units."""

    reference: str
    candidate: str
    max_diff: int
    mean_diff: float


def image_diff_plot(images: dict[str, np.ndarray], reference: str, path: Path, title: str) -> tuple[Path, list[DiffPanel]] | None:
    """Heat maps of every other variant against `reference`, on one shared colour scale."""
    base = images[reference]
    others = [name for name, image in images.items() if name != reference and image.shape == base.shape]
    if not others:
        return None
    diffs = {name: np.abs(images[name].astype(np.int16) - base.astype(np.int16)).max(axis=-1) for name in others}
    vmax = max(1, max(int(d.max()) for d in diffs.values()))
    figure = Figure(figsize=(3.2 * len(others) + 0.8, 3.4), layout="constrained")
    axes = figure.subplots(1, len(others), squeeze=False)[0]
    shown = None
    panels = []
    for axis, name in zip(axes, others):
        diff = diffs[name]
        shown = axis.imshow(diff, cmap="magma", vmin=0, vmax=vmax, interpolation="nearest")
        axis.set_title(f"|{name} - {reference}|\nmax {int(diff.max())}, mean {diff.mean():.3g}", fontsize=8)
        axis.set_axis_off()
        panels.append(DiffPanel(reference, name, int(diff.max()), float(diff.mean())))
    assert shown is not None  # a panel per other image, and there is one
    figure.colorbar(shown, ax=list(axes), shrink=0.8, label="abs difference (0-255)")
    figure.suptitle(title, fontsize=9)
    return _save(figure, path), panels

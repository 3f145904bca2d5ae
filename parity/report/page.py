"""`index.html`: one static page per run directory that a reviewer opens from disk.

In order: the model families the target does not provide (one line each), what failed (the
per-suite summary, the failing rows, the checks that did not run grouped by reason), where each
failing case that was localised diverges (its stage chain: the blamed stage, the stages, a plot of
each stage's error against its bound, the repro; absent when no case was), what changed against
the baseline, then one view per suite that has one and has rows in this run (where numerics
diverged, where decoding diverged, what recompiled and why, what the images look like, the routing
audit, the sensitivity table), every suite's rows (failing rows first) and the environment.

The page is sized to what ran: a `skip` row (a suite test that did not run, with pytest's reason)
is never listed row by row in a suite's view or rows; they are counted, one line per distinct
reason, and a suite that only skipped is those lines. A family the target leaves out
(`family_not_provided` rows, one per suite of that family) is one line at the top, in no table.

The suites come from the rows: the summary, the navigation and "All rows by suite" list every
suite found in `results.csv`, whatever its name, so a new suite needs no change here. A suite-
specific view (`SUITE_VIEWS`) is drawn only when its suite has rows in the run; without them the
view is left out, not shown empty.

The page links only to files inside the run directory (relative paths: `results.csv`, `run.json`,
`images/...`, and the figures it writes under `review/`), loads nothing from the network and
needs no server. Every piece of text from the rows is escaped with `html.escape`.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import math
import numbers
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pandas as pd

from parity.compare import ERROR, FAIL, NOT_APPLICABLE, PASS, SKIP, TIE_FLIP
from parity.report import case_lines
from parity.report.baseline import INFO_LIST_FACTOR, Comparison, target_name
from parity.report.chains import (
    LINE_COLUMNS,
    Localised,
    StageChain,
    chain_lines,
    localise_mask,
    localised_cases,
    repro_file,
)
from parity.report.plots import (
    OTHER_SITES,
    SITE_FAMILIES,
    SiteFamily,
    decode_step_plot,
    divergence_plot,
    image_diff_plot,
    load_png,
    site_family,
    site_order,
    stage_chain_plot,
)
from parity.report.review import Review, failing_first, failing_suites_first, used_share
from parity.report.rows import NOT_PROVIDED, RESULTS_FILE, RUN_INFO_FILE, mutation_score, summarize
from parity.report.rundir import UnsafePathError, atomic_write, refuse_link

PAGE_FILE = "index.html"
ASSET_DIR = "review"  # figures the page draws; replaced on every page build (only when parity wrote it: Assets)
IMAGES_DIR = "images"  # PNGs a suite writes: images/<case>/<variant>.png
VARIANT_ORDER = ("reference", "serving_eager", "serving_compiled")
MAX_TABLE_ROWS = 3000  # beyond this a table points at results.csv instead of bloating the page
_SEVERITY = {SKIP: -2, NOT_APPLICABLE: -1, PASS: 0, TIE_FLIP: 1, FAIL: 2, ERROR: 3}

# The plugin's rows for checks that did not run (verdict `skip`, kind info): one per skipped suite
# test (metric `skipped`, pytest's reason in `detail`) and, per suite of a family the target does not
# provide, one for all its deselected tests (this metric; `case` = the family key of
# parity.target.FAMILIES or the suite directory, `value` = how many tests, `detail` = the reason).
FAMILY_METRIC = NOT_PROVIDED

ROW_COLUMNS = ("verdict", "case", "mode", "site", "metric", "value", "threshold", "better", "kind", "detail")

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px; padding: 0 1em; color: #1d1d1f; }
h1 { font-size: 1.5em; margin-bottom: .2em; } h2 { border-bottom: 2px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
h3 { margin-bottom: .3em; }
table { border-collapse: collapse; margin: .5em 0 1em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f1f1f4; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.detail { max-width: 46em; overflow-wrap: anywhere; }
tr.fail td { background: #fde2e2; } tr.error td { background: #f8c4c4; } tr.tie_flip td { background: #fff1c9; }
tr.regression td { background: #fde2e2; } tr.improvement td { background: #e1f5e1; }
.status { padding: .6em 1em; border-radius: 6px; font-weight: 600; display: inline-block; }
.status.ok { background: #e1f5e1; color: #17631a; } .status.failed { background: #fde2e2; color: #8a1212; }
.note { color: #666; font-style: italic; } nav a { margin-right: 1em; }
figure { display: inline-block; margin: 0 1em 1em 0; vertical-align: top; }
figure img { border: 1px solid #ccc; image-rendering: pixelated; }
figcaption { font-size: 12px; color: #444; max-width: 40em; }
img.broken { outline: 3px solid crimson; min-width: 40px; min-height: 40px; }
#broken-images { color: crimson; font-weight: 600; }
#not-provided p { margin: .2em 0; padding: .3em .8em; background: #f1f1f4; border-left: 4px solid #999; }
table.tokens td.tokens { font-family: ui-monospace, monospace; font-size: 12px; max-width: 60em; overflow-wrap: anywhere; }
mark { background: #f8c4c4; font-weight: 600; }
tr.blamed td { background: #f8c4c4; font-weight: 600; } tr.not_applicable td { color: #777; }
tr.folded td { font-style: italic; } .blamed-stage { font-size: 1.05em; } .blamed-stage b { color: #8a1212; }
"""

# Marks the page with how many of its images loaded, and flags any that did not (a moved file),
# both for the reader and for the headless-browser test (tests/report/test_review_browser.py).
SCRIPT = """
window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var broken = images.filter(function (img) { return !(img.complete && img.naturalWidth > 0); });
  document.body.setAttribute("data-images-total", String(images.length));
  document.body.setAttribute("data-images-loaded", String(images.length - broken.length));
  broken.forEach(function (img) { img.classList.add("broken"); });
  if (broken.length) {
    var note = document.getElementById("broken-images");
    note.textContent = broken.length + " image(s) failed to load";
    note.hidden = false;
  }
});
"""


# ---------------------------------------------------------------------------------------------
# HTML helpers
# ---------------------------------------------------------------------------------------------


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def fmt_number(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.4g}"
    return str(value)


def href(relative: str | Path) -> str:
    """A relative link, percent-encoded (case names hold `=`, `,` and spaces)."""
    return quote(Path(relative).as_posix(), safe="/")


def table(
    frame: pd.DataFrame,
    columns: Sequence[str],
    *,
    headers: Sequence[str] | None = None,
    row_class: Callable[[pd.Series], str] | None = None,
    table_id: str = "",
    limit: int = MAX_TABLE_ROWS,
) -> str:
    """An HTML table of `columns` of `frame` (numbers formatted, text escaped, verdict-coloured rows)."""
    headers = list(headers or columns)
    attrs = f' id="{esc(table_id)}"' if table_id else ""
    out = [f"<table{attrs}>", "<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in headers) + "</tr></thead>", "<tbody>"]
    for _, row in frame.head(limit).iterrows():
        css = row_class(row) if row_class else str(row.get("verdict", ""))
        cells = []
        for column in columns:
            value = row.get(column, "")
            number = isinstance(value, numbers.Number) and not isinstance(value, bool)
            klass = "num" if number else ("detail" if column in ("detail", "why", "reason") else "")
            cells.append(f'<td class="{klass}">{esc(fmt_number(value))}</td>' if klass else f"<td>{esc(fmt_number(value))}</td>")
        out.append(f'<tr class="{esc(css)}">' + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    if len(frame) > limit:
        out.append(f'<p class="note">{len(frame) - limit} more rows in <a href="{RESULTS_FILE}">{RESULTS_FILE}</a></p>')
    return "\n".join(out)


def note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{esc(anchor)}">\n<h2>{esc(title)}</h2>\n{body}\n</section>'


def worst_verdict(verdicts: Iterable[str]) -> str:
    verdicts = [v for v in verdicts if v in _SEVERITY]
    return max(verdicts, key=_SEVERITY.__getitem__) if verdicts else ""


def _gate_verdict(rows: pd.DataFrame) -> str:
    gates = rows[rows["kind"] != "info"]
    return worst_verdict((gates if not gates.empty else rows)["verdict"])


class Assets:
    """The figure directory of the page, `review/` (docs/reports.md §2-§3).

    Figures are drawn into a fresh directory made for this build (`mkdtemp`: nothing planted in
    advance, a symbolic link included, can be written through) and moved to `review/` when the page
    is done (`commit`), with `.parity-review` listing the files it holds. An existing `review/` is
    replaced only when it is parity's: a real directory whose every entry its list names (or, from
    before the list, only the page's own figures); anything else is refused with one line, before
    anything is drawn, so a review never takes a file a user put there.
    """

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.root = run_dir / ASSET_DIR
        check_review_dir(self.root)
        self.staging = Path(tempfile.mkdtemp(prefix=f".{ASSET_DIR}-", dir=run_dir))
        os.chmod(self.staging, run_dir.stat().st_mode & 0o777)  # readable as the run directory is (mkdtemp: 0700)
        self._names: set[str] = set()

    def path(self, stem: str) -> Path:
        """A new PNG path for `stem` (made file-name safe and unique); in review/ once committed."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)[:120] or "figure"
        name, n = safe, 1
        while name in self._names:
            n += 1
            name = f"{safe}-{n}"
        self._names.add(name)
        return self.staging / f"{name}.png"

    def relative(self, path: Path) -> str:
        """Where the page links `path`: review/<name>, relative to the run directory."""
        return f"{ASSET_DIR}/{path.relative_to(self.staging).as_posix()}"

    def commit(self) -> Path:
        """Move the figures to review/, replacing the previous build's (checked again: it is parity's)."""
        files = sorted(p.name for p in self.staging.iterdir())
        atomic_write(self.staging / REVIEW_MARKER, "".join(f"{name}\n" for name in files))
        if self.root.exists() or self.root.is_symlink():
            check_review_dir(self.root)
            old = Path(tempfile.mkdtemp(prefix=f".{ASSET_DIR}-old-", dir=self.run_dir))
            os.replace(self.root, old / ASSET_DIR)
            os.replace(self.staging, self.root)
            shutil.rmtree(old)
        else:
            os.replace(self.staging, self.root)
        return self.root

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


REVIEW_MARKER = ".parity-review"  # in review/: the files the page wrote there, one name a line


def check_review_dir(root: Path) -> None:
    """Refuse (`UnsafePathError`, one line) a review/ that parity did not write: a symbolic link,
    a file, or a directory holding anything its `.parity-review` list does not name."""
    if root.is_symlink():
        refuse_link(root, f"the page's figure directory {ASSET_DIR}/")
    if not root.exists():
        return
    if not root.is_dir():
        raise UnsafePathError(f"{root}: not a directory; parity review writes the page's figures there: move it away")
    entries = {p.name: p for p in root.iterdir()}
    marker = entries.pop(REVIEW_MARKER, None)
    regular = {name for name, p in entries.items() if p.is_file() and not p.is_symlink()}
    if marker is None:
        foreign = sorted(entries)
    elif marker.is_symlink() or not marker.is_file():
        foreign = [REVIEW_MARKER]
    else:
        listed = set(marker.read_text(encoding="utf-8", errors="replace").splitlines())
        foreign = sorted(name for name in entries if name not in regular or name not in listed)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UnsafePathError(
            f"{root}: holds {shown}, which parity review did not write; it replaces {ASSET_DIR}/ on every review: "
            "move them elsewhere"
        )


def suites_in(frame: pd.DataFrame) -> list[str]:
    """The suites that have rows in this run, failing suites first, then by name."""
    if frame.empty:
        return []
    names = frame["suite"].unique()
    return sorted(names, key=lambda s: (-_SEVERITY.get(_gate_verdict(frame[frame["suite"] == s]), 0), s))


# ---------------------------------------------------------------------------------------------
# What ran, what did not
# ---------------------------------------------------------------------------------------------


def family_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The `family_not_provided` rows: one per (family the target leaves out, suite of it)."""
    return frame[(frame["metric"] == FAMILY_METRIC) & (frame["verdict"] == SKIP)]


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


def skip_lines(skipped: pd.DataFrame, *, nothing_ran: bool) -> str:
    """One line per distinct skip reason with its count; `nothing_ran`: the suite only skipped."""
    lead = "nothing ran: " if nothing_ran else ""
    return "\n".join(
        f'<p class="note skip-reason">{esc(lead)}{n} {"test" if n == 1 else "tests"} skipped: {esc(reason)}</p>'
        for reason, n in skip_reasons(skipped)
    )


# parity.target.family_gap's reason: "target 'x' provides no DiT (no load_dit, build_dit): ..."
_FAMILY_GAP = re.compile(r"provides no (?P<what>.+?) \(no (?P<members>[^)]*)\)")


def not_provided_block(frame: pd.DataFrame) -> str:
    """One line per family the target does not provide (its `family_not_provided` rows), naming the
    missing members and the suites not run; empty when every family ran."""
    rows = family_rows(frame)
    if rows.empty:
        return ""
    lines = []
    for family, group in rows.groupby("case", sort=False):
        reason = next((d for d in group["detail"] if d), "")
        found = _FAMILY_GAP.search(reason)
        suites = list(dict.fromkeys(group["suite"]))
        tests = pd.to_numeric(group["value"], errors="coerce").dropna()
        count = f" ({int(tests.sum())} tests)" if not tests.empty else ""
        not_run = f"{'suite' if len(suites) == 1 else 'suites'} {', '.join(suites)} not run{count}"
        if found:  # a model family the target does not provide
            name = found["what"]
            text = f"{name[:1].upper()}{name[1:]}: not provided by this target (no {found['members']}): {not_run}"
        else:  # a suite that does not apply to this target (the mutant catalogue)
            text = f"{family}: {not_run}: {reason}"
        lines.append(f'<p class="family" title="{esc(reason)}">{esc(text)}</p>')
    return '<div id="not-provided">\n' + "\n".join(lines) + "\n</div>"


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


def summary_section(review: Review) -> str:
    frame = listed(review.frame)
    summary = summarize(frame)
    if summary.empty:
        return section("summary", "Summary", note("no report rows in this run"))
    summary = failing_suites_first(summary)

    def suite_class(row: pd.Series) -> str:
        return "error" if row["error"] else ("fail" if row["fail"] else ("tie_flip" if row["tie_flip"] else "pass"))

    body = [
        table(
            summary,
            ("suite", "cases", "pass", "fail", "tie_flip", "error", "not_applicable", "skip", "worst"),
            row_class=suite_class,
            table_id="summary-table",
        )
    ]
    failing = review.failing
    if not failing.empty:  # one line per failing case, each rule once (parity.report.case_lines)
        body.append("<h3>Failing cases</h3>")
        body.append(case_lines.html_block(review.frame, review.run_dir))
    body.append("<h3>Failing rows</h3>")
    if failing.empty:
        body.append(note("no gate row failed or errored"))
    else:
        body.append(
            table(
                case_lines.without_rules(failing),
                ("verdict", "suite", "case", "mode", "site", "metric", "value", "threshold", "better", "detail"),
                table_id="failing-rows",
            )
        )
    flips = review.frame[(review.frame["kind"] != "info") & (review.frame["verdict"] == TIE_FLIP)]
    if not flips.empty:
        body.append(f"<h3>Tie flips ({len(flips)} rows: decisions inside the dtype's noise, not defects)</h3>")
        body.append(table(flips, ("verdict", "suite", "case", "mode", "site", "metric", "value", "threshold", "detail")))
    skipped = frame[frame["verdict"] == SKIP]
    if not skipped.empty:
        grouped = pd.DataFrame(
            [
                {"suite": suite, "tests": n, "reason": reason}
                for suite in dict.fromkeys(skipped["suite"])
                for reason, n in skip_reasons(skipped[skipped["suite"] == suite])
            ]
        )
        body.append(f"<h3>Skipped ({len(skipped)} tests that did not run here, by suite and reason)</h3>")
        body.append(table(grouped, ("suite", "tests", "reason"), row_class=lambda _: SKIP, table_id="skipped-rows"))
    not_applicable = frame[(frame["verdict"] == NOT_APPLICABLE) & (frame["kind"] != "info")]
    if not not_applicable.empty:
        body.append(f"<h3>Not applicable ({len(not_applicable)} rows: checks that do not apply here, with the reason)</h3>")
        body.append(
            table(not_applicable, ("verdict", "suite", "case", "mode", "metric", "detail"), table_id="not-applicable-rows")
        )
    return section("summary", "Summary: what failed", "\n".join(body))


def _outcome_class(kind: str) -> Callable[[pd.Series], str]:
    return lambda row: kind


def baseline_section(review: Review) -> str:
    comparison: Comparison | None = review.comparison
    if comparison is None:
        text = review.baseline_note or "not compared with a baseline (run `parity review RUN_DIR` to compare)"
        return section("baseline", "Against the baseline", note(text))
    body = [
        f"<p>Baseline <code>{esc(comparison.baseline)}</code>: {comparison.matched} rows matched; a gate row is a "
        f"regression when its verdict went to fail/error, its bound was loosened, or it uses more than "
        f"{comparison.margin:.0%} more of its bound than before (docs/reports.md §7).</p>"
    ]
    if comparison.suites_not_run:
        body.append(note("not compared (no rows in this run): " + ", ".join(comparison.suites_not_run)))
    for why, count in comparison.not_compared.items():
        body.append(note(f"not compared ({count} baseline rows): {why}"))
    outcome_columns = (
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
    for title, frame, kind in (
        ("Regressions", comparison.regressions, "regression"),
        ("Improvements", comparison.improvements, "improvement"),
    ):
        body.append(f"<h3>{title} ({len(frame)})</h3>")
        body.append(
            table(frame, outcome_columns, row_class=_outcome_class(kind), table_id=kind + "s")
            if not frame.empty
            else note("none")
        )
    for title, cases, kind in (
        ("New cases", comparison.new_cases(), "new"),
        ("Vanished cases (a vanished gate row fails the review)", comparison.vanished_cases(), "regression"),
    ):
        body.append(f"<h3>{esc(title)} ({len(cases)})</h3>")
        body.append(
            table(cases, ("suite", "case", "target", "mode", "rows", "gate_rows"), row_class=_outcome_class(kind))
            if not cases.empty
            else note("none")
        )
    changed = comparison.changed
    body.append(f"<details><summary>Changed gate rows, neither better nor worse by the rule ({len(changed)})</summary>")
    body.append(table(changed, outcome_columns, row_class=_outcome_class("")) if not changed.empty else note("none"))
    body.append("</details>")
    moves = comparison.info_moves
    body.append(
        f"<details><summary>Info rows that moved more than {comparison.margin:.0%} ({len(moves)}; "
        f"{len(comparison.large_info_moves())} by more than x{INFO_LIST_FACTOR:g}): never a regression</summary>"
    )
    body.append(table(moves, outcome_columns, row_class=_outcome_class("")) if not moves.empty else note("none"))
    body.append("</details>")
    return section("baseline", "Against the baseline", "\n".join(body))


# ---------------------------------------------------------------------------------------------
# Where it diverges: the stage chains of the failing cases (parity.report.chains)
# ---------------------------------------------------------------------------------------------

LOCALISE_ANCHOR = "localise"
MAX_LOCALISED = 12  # localised cases drawn in full (table and plot); more are one line each


def _case_verdict(frame: pd.DataFrame, found: Localised) -> str:
    rows = frame[(frame["suite"] == found.suite) & (frame["case"] == found.case) & (frame["mode"] == found.mode)]
    return _gate_verdict(rows)


def _repro_line(review: Review, relative: str) -> str:
    """A link to the repro the blame row names, only when it is a file inside the run directory."""
    if not relative:
        return ""
    path = repro_file(review.run_dir, relative)
    if path is None:
        return note(f"repro {relative}: no such file inside this run directory")
    rel = path.relative_to(review.run_dir).as_posix()
    return (
        f'<p class="repro">Repro: <a class="repro" href="{href(rel)}">{esc(rel)}</a> '
        f"(standalone where parity is installed: <code>python {esc(rel)}</code>)</p>"
    )


def _piece_lines(pieces: pd.DataFrame) -> list[str]:
    """The compile-only bisection's answer: the smallest compiled module that differs from itself run eagerly."""
    lines = []
    for _, piece in pieces.iterrows():
        named = (
            f"the smallest compiled piece whose output differs from the same piece run eagerly is <code>{esc(piece['site'])}</code>: "
            if piece["site"]
            else ""
        )
        lines.append(f'<p class="compile-piece">Compile-only: {named}{esc(piece["detail"])}</p>')
    return lines


def _chain_block(review: Review, found: Localised, chain: StageChain, chain_index: int, n: int, assets: Assets) -> str:
    """One chain: the blamed stage, the summary, the repro, the stage table and the plot."""
    body = []
    if len(found.chains) > 1:
        body.append(f"<h4>Localisation {n + 1} of {len(found.chains)}</h4>")
    if chain.blamed:
        body.append(f'<p class="blamed-stage">First diverging stage: <b>{esc(chain.blamed)}</b></p>')
    body.append(f'<p class="chain-summary">{esc(chain.summary)}</p>')
    body.append(_repro_line(review, chain.repro))
    if chain.stages.empty:
        return "\n".join(body + [note("no stage rows before its first_diverging_stage row")])
    lines, folded = chain_lines(chain)
    if folded:
        opened = f"every stage of the layer holding {chain.focus()}, " if chain.focus() else ""
        body.append(
            note(
                f"{len(chain.stages)} stages: {opened}every stage outside the layers, and the other {folded} layers one line "
                f"each (how many stages diverged, the worst against its bound); every stage is a row of {RESULTS_FILE}"
            )
        )
    body.append(table(lines, LINE_COLUMNS, row_class=lambda row: row["_class"], table_id=f"stages-{chain_index}"))
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
    if drawn is None:
        body.append(note("no stage was judged: nothing to plot"))
    else:
        path, caption = drawn
        text = f"{where}: each stage's value / bound in execution order, log scale; dashed line: the bound"
        body.append(
            f'<figure><img src="{href(assets.relative(path))}" alt="{esc(where)}: stage chain">'
            f"<figcaption>{esc(text)}{esc('; ' + caption) if caption else ''}</figcaption></figure>"
        )
    return "\n".join(b for b in body if b)


def localise_section(review: Review, assets: Assets) -> str:
    """Where each localised case diverges; '' when no case was localised (no section, no link)."""
    cases = localised_cases(review.frame)
    if not cases:
        return ""
    body = [
        "<p>Each failing case the suites re-ran with stage taps: every stage of its family in execution order, "
        "its error against the fp64 golden (an exact stage: entries that differ from the reference) and the bound "
        "the golden noise floor gives it. The stage blamed is the first out of bound whose inputs are within bound; "
        "a stage that only inherits the error is not blamed (docs/localise.md §3).</p>"
    ]
    chain_index = 0
    for k, found in enumerate(cases[:MAX_LOCALISED]):
        where = f"{found.suite} / {found.case} / {found.mode}"
        verdict = _case_verdict(review.frame, found)
        body.append(f'<div class="localised" id="localise-{k}">')
        body.append(f"<h3>{esc(where)}: {esc(verdict)}</h3>")
        body += _piece_lines(found.pieces)
        for n, chain in enumerate(found.chains):
            body.append(_chain_block(review, found, chain, chain_index, n, assets))
            chain_index += 1
        body.append("</div>")
    rest = cases[MAX_LOCALISED:]
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
        body.append(f"<h3>{len(rest)} more localised cases</h3>")
        body.append(table(frame, frame.columns.tolist(), row_class=lambda _: FAIL, table_id="localised-more"))
    return section(LOCALISE_ANCHOR, "Where it diverges", "\n".join(body))


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
                "verdict": _gate_verdict(group),
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
    return failing_first(frame.assign(kind="gate", value=math.nan, threshold=math.nan, better="")) if not frame.empty else frame


def numerics_view(review: Review, rows: pd.DataFrame, assets: Assets) -> str:
    body = ["<h3>First diverging site per case</h3>"]
    body.append(
        table(
            _first_divergence(rows),
            ("case", "mode", "verdict", "first_failing_site", "at_first_failure", "nearest_to_bound"),
            table_id="numerics-divergence",
        )
    )
    sited = rows[rows["site"] != ""]
    families: dict[SiteFamily, list[str]] = {}
    for site in site_order(sited["site"].tolist()):
        families.setdefault(site_family(site), []).append(site)
    if not families:
        body.append(note("no per-site rows (site column empty): nothing to plot by layer"))
    for family in (*SITE_FAMILIES, OTHER_SITES):
        if family not in families:
            continue
        family_rows = sited[sited["site"].isin(families[family])]
        drawn = divergence_plot(family_rows, ("max_abs", "rel_l2"), assets.path(f"numerics-{family.key}"), family.title)
        if drawn is None:
            body.append(note(f"{family.title}: no finite max_abs / rel_l2 values to plot"))
            continue
        path, caption = drawn
        text = f"{family.title}: max_abs and rel_l2 by site, one line per (case, mode), log scale; dashed line = the gate's bound"
        body.append(
            f'<figure><img src="{href(assets.relative(path))}" alt="{esc(family.title)}">'
            f"<figcaption>{esc(text)}{esc('; ' + caption) if caption else ''}</figcaption></figure>"
        )
    return "\n".join(body)


# The decode suite's rows (parity.suites.ar.test_decode): the free-running gate `matched_steps`
# (value: steps whose tokens equal the reference's, threshold: the case's steps), `tokens` info
# rows (site `reference` / `target`, detail `row R: t0 t1 ...; row R+1: ...`), per-bucket
# teacher-forced rows (`teacher_forced.steps.A-B`, info `max_abs`) and `step_max_abs` (site
# `teacher_forced`, the per-step values after the detail's last `: `).
MAX_DECODE_DETAILS = 12  # failing decode runs drawn in full; more are listed in the table
_TOKEN_ROW = re.compile(r"row (?P<row>\d+): (?P<tokens>[-\d ]*)")


def parse_tokens(detail: str) -> list[list[int]] | None:
    """A `tokens` row's detail as one token list per batch row; None when it is not one."""
    rows = [[int(t) for t in match["tokens"].split()] for match in _TOKEN_ROW.finditer(detail or "")]
    return rows or None


def parse_step_errors(detail: str) -> list[float] | None:
    """A `step_max_abs` row's per-step values (after the detail's last `: `); None when unreadable."""
    try:
        values = [float(v) for v in (detail or "").rsplit(": ", 1)[-1].split()]
    except ValueError:
        return None
    return values or None


def _number(value: Any) -> float | None:  # a cell of the rows' frame
    return None if value is None or pd.isna(value) else float(value)


@dataclasses.dataclass
class DecodeRun:
    """One decode case in one mode: its verdict, where its tokens diverged, both sequences, the
    step logits' error per step."""

    case: str
    mode: str
    rows: pd.DataFrame

    @functools.cached_property
    def verdict(self) -> str:
        return _gate_verdict(self.rows)

    def _one(self, metric: str, site: str | None = None) -> pd.Series | None:
        mine = self.rows[(self.rows["metric"] == metric) & ((self.rows["site"] == site) if site is not None else True)]
        return mine.iloc[-1] if not mine.empty else None

    @functools.cached_property
    def tokens(self) -> dict[str, list[list[int]]]:
        found = {}
        for side in ("target", "reference"):
            row = self._one("tokens", side)
            parsed = parse_tokens(row["detail"]) if row is not None else None
            if parsed is not None:
                found[side] = parsed
        return found

    @property
    def steps(self) -> int | None:
        matched = self._one("matched_steps")
        if matched is not None and _number(matched["threshold"]) is not None:
            return int(matched["threshold"])
        return max((len(r) for rows in self.tokens.values() for r in rows), default=None)

    @property
    def matched(self) -> int | None:
        row = self._one("matched_steps")
        return int(row["value"]) if row is not None and _number(row["value"]) is not None else None

    @property
    def diverged_at(self) -> int | None:
        """The first step whose token differs from the reference's (any batch row), or None."""
        if len(self.tokens) == 2:
            steps = [
                i
                for want, got in zip(self.tokens["reference"], self.tokens["target"])
                for i, (a, b) in enumerate(zip(want, got))
                if a != b
            ] + [min(len(w), len(g)) for w, g in zip(self.tokens["reference"], self.tokens["target"]) if len(w) != len(g)]
            return min(steps) if steps else None
        matched, total = self.matched, self.steps
        return matched if matched is not None and total is not None and matched < total else None

    def step_errors(self) -> tuple[str, list[float]] | None:
        """(label, per-step values) of the `step_max_abs` row; None when the run has none."""
        row = self._one("step_max_abs")
        values = parse_step_errors(row["detail"]) if row is not None else None
        if values:
            return "teacher-forced, largest |d| per step", values
        return None

    @property
    def largest_step_diff(self) -> float:
        errors = self.step_errors()
        finite = [v for v in errors[1] if not math.isnan(v)] if errors else []
        return max(finite) if finite else math.nan

    @property
    def detail(self) -> str:
        row = self._one("matched_steps")
        return row["detail"] if row is not None else " | ".join(dict.fromkeys(d for d in self.rows["detail"] if d))

    def headline(self) -> str:
        steps, matched, diverged = self.steps, self.matched, self.diverged_at
        if diverged is not None:
            return (
                f"tokens diverged at step {diverged}"
                + (f" of {steps}" if steps is not None else "")
                + (f" (the first {diverged} tokens equal the reference's)" if diverged else " (the first token already differs)")
            )
        if matched is not None:
            return f"tokens equal the reference's at all {matched} steps; the step logits failed"
        return "no free-running result in this run"


def _token_cells(tokens: list[int], other: list[int]) -> str:
    """A sequence, the tokens that differ from `other` at the same step marked."""
    return " ".join(f"<mark>{t}</mark>" if i >= len(other) or other[i] != t else str(t) for i, t in enumerate(tokens))


def _token_table(run: DecodeRun, table_id: str) -> str:
    reference, target = run.tokens["reference"], run.tokens["target"]
    out = [
        f'<table class="tokens" id="{esc(table_id)}">',
        "<thead><tr><th>side</th><th>row</th><th>tokens</th></tr></thead>",
        "<tbody>",
    ]
    for side, mine, other in (("target", target, reference), ("reference", reference, target)):
        for row, tokens in enumerate(mine):
            others = other[row] if row < len(other) else []
            out.append(
                f'<tr><td>{side}</td><td class="num">{row}</td><td class="tokens">{_token_cells(tokens, others)}</td></tr>'
            )
    out.append("</tbody></table>")
    return "\n".join(out)


def decode_view(review: Review, rows: pd.DataFrame, assets: Assets) -> str:
    runs = [DecodeRun(case, mode, group) for (case, mode), group in rows.groupby(["case", "mode"], sort=False)]
    failing = [run for run in runs if run.verdict in (FAIL, ERROR)]
    flips = sum(run.verdict == TIE_FLIP for run in runs)
    passing = sum(run.verdict == PASS for run in runs)
    body = [
        f"<p>{len(runs)} decode runs (case, mode): {len(failing)} failing, {flips} with tie flips only, {passing} passing.</p>"
    ]
    for i, run in enumerate(failing[:MAX_DECODE_DETAILS]):
        where = f"{run.case} / {run.mode}"
        body.append(f'<h3 id="decode-{i}">{esc(where)}: {esc(run.verdict)}</h3>')
        body.append(f'<p class="decode-divergence">{esc(run.headline())}</p>')
        gates = failing_first(run.rows[(run.rows["kind"] != "info") & run.rows["verdict"].isin((FAIL, ERROR))])
        body.append(table(gates, ("verdict", "site", "metric", "value", "threshold", "detail"), table_id=f"decode-failing-{i}"))
        if len(run.tokens) == 2:
            body.append(_token_table(run, f"decode-tokens-{i}"))
        else:
            body.append(
                note(
                    "token sequences not recorded in this run (the decode suite's `tokens` rows); the detail above names the differing tokens"
                )
            )
        errors = run.step_errors()
        drawn = (
            decode_step_plot([errors], assets.path(f"decode-{run.case}-{run.mode}"), f"{where}: step logits", run.diverged_at)
            if errors
            else None
        )
        if drawn is None or errors is None:
            body.append(note("no per-step error of the step logits to plot"))
        else:
            path, caption = drawn
            text = f"{where}: {errors[0]}, log scale" + (
                "; dotted line: the step where the tokens diverged" if run.diverged_at is not None else ""
            )
            body.append(
                f'<figure><img src="{href(assets.relative(path))}" alt="{esc(where)}: step logits error by step">'
                f"<figcaption>{esc(text)}{esc('; ' + caption) if caption else ''}</figcaption></figure>"
            )
    drawn_in_full = {id(run) for run in failing[:MAX_DECODE_DETAILS]}
    rest = [run for run in runs if id(run) not in drawn_in_full]
    if rest:
        more = len(failing) - len(drawn_in_full)
        title = "Passing decode runs" + (" and tie flips" if flips else "") + (f", and {more} more failing" if more else "")
        body.append(f"<h3>{esc(title)}</h3>")
        frame = pd.DataFrame(
            [
                {
                    "case": run.case,
                    "mode": run.mode,
                    "verdict": run.verdict,
                    "steps_matched": f"{run.matched} of {run.steps}" if run.matched is not None and run.steps is not None else "",
                    "diverged_at": run.diverged_at if run.diverged_at is not None else "",
                    "largest_step_diff": run.largest_step_diff,
                    "detail": run.detail,
                }
                for run in rest
            ]
        )
        frame = failing_first(frame.assign(kind="gate", value=math.nan, threshold=math.nan, better=""))
        body.append(
            table(
                frame,
                ("case", "mode", "verdict", "steps_matched", "diverged_at", "largest_step_diff", "detail"),
                table_id="decode-runs",
            )
        )
    return "\n".join(body)


# Ledger metrics, bare (`compiles`) or per code object as parity.observe.compile_ledger names them
# (`compiles[TransformerBlock.forward]`, `recompiles[...]`).
LEDGER_METRICS = ("compiles", "new_compiles", "recompiles")
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
                "verdict": _gate_verdict(group),
                "reason": " | ".join(dict.fromkeys(d for d in group["detail"] if d)),
            }
        )
    return pd.DataFrame(lines)


def recompiles_view(review: Review, rows: pd.DataFrame, assets: Assets) -> str:
    parts = rows["metric"].map(split_metric)
    rows = rows.assign(_base=parts.str[0], _code=parts.str[1])
    in_ledger = rows["_base"].isin(LEDGER_METRICS)
    body = []
    if in_ledger.any():
        ledger = _ledger(rows[in_ledger])
        columns = ["shape", "mode", "code", *LEDGER_METRICS, "bound", "verdict", "reason"]
        for optional in ("code", "new_compiles", "recompiles"):
            if ledger[optional].replace("", math.nan).isna().all():
                columns.remove(optional)
        body.append("<h3>Ledger (lattice order: one row per shape; compiles are cumulative)</h3>")
        body.append(table(ledger, columns, table_id="recompile-ledger"))
    else:
        body.append(note("no compiles / new_compiles rows in this run"))
    other = failing_first(rows[~in_ledger].drop(columns=["_base", "_code"]))
    if not other.empty:
        body.append("<h3>Graph breaks, regional compilation, eager fallback</h3>")
        body.append(table(other, ROW_COLUMNS))
    return "\n".join(body)


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
        entry = {"case": case, "pair": mode, "verdict": _gate_verdict(group)}
        for metric in ("psnr", "ssim"):
            mine = group[group["metric"] == metric]
            entry[metric] = mine["value"].iloc[-1] if not mine.empty else math.nan
            entry[f"{metric}_bound"] = mine["threshold"].iloc[-1] if not mine.empty else math.nan
        entry["detail"] = " | ".join(dict.fromkeys(d for d in group["detail"] if d))
        scores.append(entry)
    frame = pd.DataFrame(scores)
    return failing_first(frame.assign(kind="gate", value=math.nan, threshold=math.nan, better="")) if not frame.empty else frame


def images_view(review: Review, rows: pd.DataFrame, assets: Assets) -> str:
    cases = image_cases(review.run_dir)
    body = ["<h3>PSNR / SSIM by case (PSNR in dB, higher is better; data_range in the detail)</h3>"]
    body.append(
        table(
            _image_scores(rows),
            ("case", "pair", "verdict", "psnr", "psnr_bound", "ssim", "ssim_bound", "detail"),
            table_id="image-scores",
        )
    )
    if not cases:
        body.append(note(f"no PNGs under {IMAGES_DIR}/<case>/ in this run"))
    for case, pngs in cases.items():
        body.append(f"<h3>{esc(case)}</h3><div>")
        for png in pngs:
            rel = png.relative_to(review.run_dir).as_posix()
            body.append(
                f'<figure><a href="{href(rel)}"><img src="{href(rel)}" alt="{esc(case)}: {esc(png.stem)}" width="256"></a><figcaption>{esc(png.stem)}</figcaption></figure>'
            )
        images = {png.stem: load_png(png) for png in pngs}
        reference = "reference" if "reference" in images else pngs[0].stem
        drawn = image_diff_plot(images, reference, assets.path(f"image-diff-{case}"), f"{case}: difference against {reference}")
        if drawn is not None:
            path, panels = drawn
            text = "; ".join(f"{p.candidate}: max {p.max_diff}/255, mean {p.mean_diff:.3g}" for p in panels)
            body.append(
                f'<figure><img src="{href(assets.relative(path))}" alt="{esc(case)}: difference heat map"><figcaption>{esc(text)}</figcaption></figure>'
            )
        elif len(images) > 1:
            body.append(note("variants differ in size: no heat map"))
        body.append("</div>")
    return "\n".join(body)


ROUTING_METRICS = ("ids_mismatch", "weight_max_abs", "tie_flips")


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


def routing_view(review: Review, rows: pd.DataFrame, assets: Assets) -> str:
    points: dict[tuple[str, str], _GridPoint] = {}
    for row in rows.itertuples(index=False):
        points.setdefault((row.case, row.mode), _GridPoint()).add(row)
    frame = pd.DataFrame([point.entry(case, mode) for (case, mode), point in points.items()])
    frame = failing_first(frame.assign(kind="gate", value=math.nan, threshold=math.nan, better=""))
    counts = frame["verdict"].value_counts()
    body = [
        f"<p>{len(frame)} grid points: {int(counts.get(FAIL, 0) + counts.get(ERROR, 0))} failing, "
        f"{int(counts.get(TIE_FLIP, 0))} with tie flips only, {int(counts.get(PASS, 0))} passing.</p>",
        table(frame, ("grid_point", "mode", "verdict", *ROUTING_METRICS, "tie_flip_rows", "detail"), table_id="routing-audit"),
    ]
    return "\n".join(body)


def sensitivity_view(review: Review, rows: pd.DataFrame, assets: Assets) -> str:
    killed = rows[rows["metric"] == "killed"]
    shown = failing_first(killed if not killed.empty else rows).rename(columns={"case": "mutant", "mode": "target_suite"})
    score = mutation_score(rows)
    headline = score.line() if score is not None else "no mutant rows"
    body = [
        f"<p>{esc(headline)} (a survivor is a check that cannot fail).</p>",
        table(shown, ("verdict", "mutant", "target_suite", "metric", "value", "detail"), table_id="sensitivity-table"),
    ]
    return "\n".join(body)


def target_mutants_view(review: Review, rows: pd.DataFrame, assets: Assets) -> str:
    """The planted catalogue: each mutant planted in this run's target, its surface, who had to kill it."""
    killed = rows[rows["metric"] == "killed"]
    shown = failing_first(killed if not killed.empty else rows).rename(
        columns={"case": "mutant", "mode": "target_suite", "site": "surface"}
    )
    score = mutation_score(rows, planted_on=target_name(review.info))
    headline = score.line() if score is not None else "no mutant rows"
    body = [
        f"<p>{esc(headline)}. Each mutant was planted in this target through its checkpoint, config, capture "
        'registry or calls (docs/mutants.md, "Your target\'s score"); a survivor is a defect of that kind the suites '
        "would let through on this target, a mutant not applicable is equivalent here (its reason says why).</p>",
        table(shown, ("verdict", "mutant", "surface", "target_suite", "metric", "detail"), table_id="target-mutants-table"),
    ]
    return "\n".join(body)


@dataclasses.dataclass(frozen=True)
class SuiteView:
    """A section that reads one suite's rows; drawn only when that suite has rows in the run."""

    suite: str
    anchor: str
    title: str
    nav: str
    render: Callable[[Review, pd.DataFrame, Assets], str]


# The suite-specific views, in reading order: where it diverged, where decoding diverged, what recompiled, what the images
# look like, the routing audit, which mutants were caught. Any other suite is still listed in the
# summary, the navigation and "All rows by suite" (its rows come from the data).
SUITE_VIEWS = (
    SuiteView("numerics", "numerics", "Numerics: where it diverged", "Numerics", numerics_view),
    SuiteView("decode", "decode", "Decode: where generation diverged", "Decode", decode_view),
    SuiteView("recompiles", "recompiles", "Recompiles: what recompiled and why", "Recompiles", recompiles_view),
    SuiteView("image", "images", "Images", "Images", images_view),
    SuiteView("routing", "routing", "Routing audit", "Routing", routing_view),
    SuiteView("sensitivity", "sensitivity", "Sensitivity (mutants each suite must catch)", "Sensitivity", sensitivity_view),
    SuiteView(
        "target_mutants", "target-mutants", "Your target's score (mutants planted in it)", "Target mutants", target_mutants_view
    ),
)


def suite_views(review: Review, assets: Assets) -> list[tuple[SuiteView, str]]:
    """(view, section HTML) for every view whose suite has rows in this run, in reading order. A view
    reads only the rows that ran; its skipped tests are one line per reason, and a suite that only
    skipped is those lines (a family the target does not provide has no view: it is a line at the top)."""
    frame = listed(review.frame)
    frame = frame[~localise_mask(frame)]  # the stage chains have their own section (localise_section)
    present = set(suites_in(frame))
    out = []
    for view in SUITE_VIEWS:
        if view.suite in present:
            ran, skipped = split_skipped(frame[frame["suite"] == view.suite])
            body = [skip_lines(skipped, nothing_ran=ran.empty)] if not skipped.empty else []
            if not ran.empty:
                body.append(view.render(review, ran, assets))
            out.append((view, section(view.anchor, view.title, "\n".join(body))))
    return out


def all_rows_section(review: Review) -> str:
    frame = listed(review.frame)
    if frame.empty:
        return section("rows", "All rows by suite", note("no report rows in this run"))
    body = [
        f'<p>Every row of <a href="{RESULTS_FILE}">{RESULTS_FILE}</a> that ran, per suite, failing rows first; '
        "skipped tests one line per reason.</p>"
    ]
    for suite in suites_in(frame):
        rows = frame[frame["suite"] == suite]
        verdict = _gate_verdict(rows)
        ran, skipped = split_skipped(rows)
        is_open = " open" if verdict in (FAIL, ERROR) else ""
        counted = f"{len(ran)} rows" + (f", {len(skipped)} skipped" if not skipped.empty else "")
        body.append(
            f'<details{is_open} id="rows-{esc(suite)}"><summary><b>{esc(suite)}</b>: {counted}, worst verdict {esc(verdict)}</summary>'
        )
        if not skipped.empty:
            body.append(skip_lines(skipped, nothing_ran=ran.empty))
        if not ran.empty:
            body.append(table(failing_first(ran), ROW_COLUMNS))
        body.append("</details>")
    return section("rows", "All rows by suite", "\n".join(body))


def _env_text(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def environment_section(review: Review) -> str:
    info = dict(review.info)
    frame = review.frame
    for column in ("torch_version", "git_sha", "device", "dtype", "size", "target"):
        values = sorted(set(frame[column]) - {""}) if column in frame else []
        if values:
            info.setdefault(f"rows: {column}", ", ".join(values))
    if not info:
        return section("environment", "Environment", note(f"no {RUN_INFO_FILE} in this run directory"))
    first = ("torch", "device", "device_name", "cuda", "git_sha", "dtype", "size", "target", "run_id")
    keys = [k for k in first if k in info] + sorted(k for k in info if k not in first)
    items = pd.DataFrame([{"key": k, "value": _env_text(info[k])} for k in keys])
    body = [table(items, ("key", "value"), row_class=lambda _: "", table_id="environment")]
    if (review.run_dir / RUN_INFO_FILE).is_file():
        body.append(f'<p><a href="{RUN_INFO_FILE}">{RUN_INFO_FILE}</a></p>')
    return section("environment", "Environment", "\n".join(body))


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------


def navigation(views: Sequence[SuiteView], suites: Sequence[str], *, localised: bool = False) -> str:
    """Links to the sections on the page, then to each suite's rows (the suites of this run)."""
    anchors = [
        ("summary", "What failed"),
        *([(LOCALISE_ANCHOR, "Where it diverges")] if localised else []),
        ("baseline", "Baseline"),
        *((v.anchor, v.nav) for v in views),
        ("rows", "All rows"),
        ("environment", "Environment"),
    ]
    links = "".join(f'<a href="#{esc(anchor)}">{esc(label)}</a>' for anchor, label in anchors)
    if suites:
        links += "<br>Suites: " + "".join(f'<a href="#rows-{esc(s)}">{esc(s)}</a>' for s in suites)
    return f"<nav>{links}</nav>"


def render_page(review: Review) -> str:
    """The page's HTML; figures are written under `run_dir/review/` as a side effect."""
    assets = Assets(review.run_dir)
    try:
        text = _render(review, assets)
        assets.commit()
    except BaseException:
        assets.discard()
        raise
    return text


def _render(review: Review, assets: Assets) -> str:
    status_class = "ok" if review.ok and review.complete else "failed"
    info = review.info
    config = " ".join(
        f"{k}={info.get(k)}" for k in ("target", "device", "device_name", "dtype", "size", "git_sha", "torch") if info.get(k)
    )
    views = suite_views(review, assets)
    localised = localise_section(review, assets)
    sections = [
        summary_section(review),
        *([localised] if localised else []),
        baseline_section(review),
        *(html_ for _, html_ in views),
        all_rows_section(review),
        environment_section(review),
    ]
    nav = navigation([view for view, _ in views], suites_in(listed(review.frame)), localised=bool(localised))
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            f"<title>{esc(review.title)}</title>",
            f"<style>{CSS}</style>",
            "</head>",
            "<body>",
            f"<h1>{esc(review.title)}</h1>",
            f"<p>{esc(config)}</p>",
            f'<p><span class="status {status_class}" id="status">{esc(review.status_line())}</span></p>',
            '<p id="broken-images" hidden></p>',
            not_provided_block(review.frame),
            f'<p>{len(review.frame)} rows: <a href="{RESULTS_FILE}">{RESULTS_FILE}</a></p>',
            nav,
            *sections,
            f"<script>{SCRIPT}</script>",
            "</body>",
            "</html>",
            "",
        ]
    )


def write_page(review: Review) -> Path:
    """Write `run_dir/index.html` (and its figures), whole and never through a link (a temporary
    file created with O_EXCL, renamed over it: docs/reports.md §3); returns the page's path."""
    refuse_link(review.run_dir, "the run directory")
    text = render_page(review)
    return atomic_write(review.run_dir / PAGE_FILE, text)

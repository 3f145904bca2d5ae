"""`index.html`: one static page per run directory that a reviewer opens from disk.

In order: the model families the target does not provide (one line each), what failed (the
per-suite summary, the failing cases one line each, the failing rows, the checks that did not run
grouped by reason), where each failing case that was localised diverges (absent when no case
was), what changed against the baseline, then one view per suite that has one and has rows in this
run (`parity.report.views.SUITE_VIEWS`), every suite's rows (failing rows first) and the environment.

The suites come from the rows: the summary, the navigation and "All rows by suite" list every
suite found in `results.csv`, whatever its name, so a new suite needs no change here.

The data is assembled apart from the markup: `parity.report.sections` and `parity.report.views`
turn a `Review` into plain data, and the Jinja2 templates in parity/report/templates/ (shipped with
the package) render it, escaping every piece of text. The page links only to files inside the run
directory (relative paths: `results.csv`, `run.json`, `images/...`, and the figures it writes under
`review/`), loads nothing from the network and needs no server.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from parity.report import sections
from parity.report.chains import localise_mask
from parity.report.html import Assets, render
from parity.report.review import Review
from parity.report.rundir import atomic_write, refuse_link
from parity.report.schema import RESULTS_FILE, RUN_INFO_FILE
from parity.report.views import SUITE_VIEWS, SuiteView, suite_views

PAGE_FILE = "index.html"

__all__ = ["PAGE_FILE", "SUITE_VIEWS", "render_page", "write_page"]


def navigation(views: Sequence[SuiteView], *, localised: bool = False) -> list[tuple[str, str]]:
    """(anchor, label) of the sections on the page, in order."""
    return [
        ("summary", "What failed"),
        *([(sections.LOCALISE_ANCHOR, "Where it diverges")] if localised else []),
        ("baseline", "Baseline"),
        *((v.anchor, v.nav) for v in views),
        ("rows", "All rows"),
        ("environment", "Environment"),
    ]


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
    info = review.info
    config = " ".join(
        f"{k}={info.get(k)}" for k in ("target", "device", "device_name", "dtype", "size", "git_sha", "torch") if info.get(k)
    )
    listed = sections.listed(review.frame)
    # the stage chains have their own section (localise_section), not the suites' views
    views = suite_views(review, assets, listed[~localise_mask(listed)])
    localise = sections.localise_section(review, assets)
    return render(
        "page.html.j2",
        title=review.title,
        config=config,
        status_class="ok" if review.ok and review.complete else "failed",
        status=review.status_line(),
        not_provided=sections.not_provided(review.frame),
        rows=len(review.frame),
        nav=navigation([view for view, _ in views], localised=localise is not None),
        suites=sections.suites_in(listed),
        summary=sections.summary_section(review),
        localise=localise,
        baseline=sections.baseline_section(review),
        views=views,
        rows_by_suite=sections.all_rows_section(review),
        environment=sections.environment_section(review),
        results_file=RESULTS_FILE,
        run_info_file=RUN_INFO_FILE,
    )


def write_page(review: Review) -> Path:
    """Write `run_dir/index.html` (and its figures), whole and never through a link (a temporary
    file created with O_EXCL, renamed over it: docs/reports.md §3); returns the page's path."""
    refuse_link(review.run_dir, "the run directory")
    text = render_page(review)
    return atomic_write(review.run_dir / PAGE_FILE, text)

"""What the review page's templates draw from, and the page's figure directory.

A leaf of the page: it imports nothing of parity.report but `rundir` and `schema`, so the views, the
sections and the page skeleton (`views`, `sections`, `page`) share it without a circle. The views
turn rows into plain data (`Table`, `Figure`, text); the templates (parity/report/templates/,
Jinja2 with autoescaping: every piece of text from the rows is escaped) turn the data into markup.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from urllib.parse import quote

import jinja2
import pandas as pd

from parity.compare import ERROR, FAIL, NOT_APPLICABLE, PASS, SKIP, TIE_FLIP
from parity.report.rundir import UnsafePathError, atomic_write, refuse_link
from parity.report.schema import RESULTS_FILE

ASSET_DIR = "review"  # figures the page draws; replaced on every page build (only when parity wrote it: Assets)
REVIEW_MARKER = ".parity-review"  # in review/: the files the page wrote there, one name a line
MAX_TABLE_ROWS = 3000  # beyond this a table points at results.csv instead of bloating the page
SEVERITY = {SKIP: -2, NOT_APPLICABLE: -1, PASS: 0, TIE_FLIP: 1, FAIL: 2, ERROR: 3}
DETAIL_COLUMNS = ("detail", "why", "reason")  # free text: a cell that wraps


@functools.cache
def templates() -> jinja2.Environment:
    """The page's templates (parity/report/templates/, shipped as package data): autoescaped, and
    strict, so a template that names a value its view did not give fails instead of printing nothing."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader("parity.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(template: str, **data: object) -> str:
    """`template` rendered with `data`."""
    return templates().get_template(template).render(**data)


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


@dataclasses.dataclass(frozen=True)
class Cell:
    text: str
    klass: str = ""  # `num` (right-aligned), `detail` (wraps) or ''


@dataclasses.dataclass(frozen=True)
class Table:
    """A table as the template draws it: headers, rows (each with its CSS class) and how many rows
    were left out for results.csv."""

    headers: list[str]
    rows: list[tuple[str, list[Cell]]]
    table_id: str = ""
    more: int = 0
    results_file: str = RESULTS_FILE


def table(
    frame: pd.DataFrame,
    columns: Sequence[str],
    *,
    headers: Sequence[str] | None = None,
    row_class: Callable[[pd.Series], str] | None = None,
    table_id: str = "",
    limit: int = MAX_TABLE_ROWS,
) -> Table:
    """`columns` of `frame` as a `Table`: numbers formatted (`fmt_number`) and right-aligned, free
    text wrapping, each row's class its verdict (or `row_class(row)`)."""
    rows = []
    for _, row in frame.head(limit).iterrows():
        css = row_class(row) if row_class else str(row.get("verdict", ""))
        cells = []
        for column in columns:
            value = row.get(column, "")
            number = isinstance(value, numbers.Number) and not isinstance(value, bool)
            cells.append(Cell(fmt_number(value), "num" if number else ("detail" if column in DETAIL_COLUMNS else "")))
        rows.append((css, cells))
    return Table(list(headers or columns), rows, table_id, max(len(frame) - limit, 0))


@dataclasses.dataclass(frozen=True)
class Figure:
    """An image the page shows: its source (relative to the run directory), text and caption."""

    src: str
    alt: str
    caption: str
    link: str = ""  # the figure links to its own file
    width: int | None = None


def worst_verdict(verdicts: Iterable[str]) -> str:
    verdicts = [v for v in verdicts if v in SEVERITY]
    return max(verdicts, key=SEVERITY.__getitem__) if verdicts else ""


def gate_verdict(rows: pd.DataFrame) -> str:
    """The worst verdict of `rows`' gate rows (of all its rows when none is a gate)."""
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

    def figure(self, path: Path, alt: str, caption: str) -> Figure:
        """A drawn figure as the page shows it."""
        return Figure(href(self.relative(path)), alt, caption)

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

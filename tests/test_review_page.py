"""index.html from a real tiny run: every link and image exists, sections in review order, failing
rows first, escaping, suites discovered from the rows (a suite-specific view only when its suite
has rows, any suite name listed), and no crash on absent suites or files."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

from parity.report import read_results
from parity.report.page import PAGE_FILE, SUITE_VIEWS, split_metric, write_page
from parity.report.review import load_review
from tests.shared_run import SharedRun, copy_run, write_rows, writer_for

SECTION_ORDER = ("summary", "baseline", "numerics", "recompiles", "images", "routing", "sensitivity", "rows", "environment")
VIEW_ANCHORS = tuple(view.anchor for view in SUITE_VIEWS)


class PageParser(HTMLParser):
    """Collects the page's ids, its references (href/src) and the text of its tables by id."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.references: list[tuple[str, str]] = []
        self.title = ""
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._in_title = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if attributes.get("id"):
            self.ids.append(attributes["id"])
        for name in ("href", "src"):
            if attributes.get(name) is not None:
                self.references.append((tag, attributes[name]))
        if tag == "title":
            self._in_title = True
        if tag == "table" and attributes.get("id"):
            self._table = attributes["id"]
            self.tables[self._table] = []
        if tag == "tr" and self._table:
            self.tables[self._table].append([])
        if tag in ("td", "th") and self._table:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        if tag in ("td", "th") and self._table and self._cell is not None:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        if tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        if self._cell is not None:
            self._cell.append(data)


def parse_page(run_dir: Path) -> PageParser:
    parser = PageParser()
    parser.feed((run_dir / PAGE_FILE).read_text(encoding="utf-8"))
    return parser


def broken_references(run_dir: Path) -> list[str]:
    """References of the page that do not resolve to a file in the run directory or an id on it."""
    page = parse_page(run_dir)
    broken = []
    for tag, ref in page.references:
        parts = urlsplit(ref)
        if parts.scheme or parts.netloc or ref.startswith("/"):
            broken.append(f"{tag} {ref}: not a relative link")
        elif not parts.path:
            if parts.fragment not in page.ids:
                broken.append(f"{tag} {ref}: no element with that id")
        else:
            target = (run_dir / unquote(parts.path)).resolve()
            if run_dir.resolve() not in target.parents or not target.is_file():
                broken.append(f"{tag} {ref}: no such file in the run directory")
    return broken


def rebuild(run_dir: Path) -> PageParser:
    write_page(load_review(run_dir, use_default_baseline=False))
    return parse_page(run_dir)


def test_parity_run_writes_the_page(lane_run: SharedRun) -> None:
    assert (lane_run.run_dir / PAGE_FILE).is_file()  # written by `parity run` itself: readers change copies
    assert f"review page: {lane_run.run_dir / PAGE_FILE}" in lane_run.stdout


def test_every_link_and_image_of_the_page_exists(lane_run: SharedRun) -> None:
    page = parse_page(lane_run.run_dir)
    images = [ref for tag, ref in page.references if tag == "img"]
    assert images, "the page shows no image"
    assert any(ref.startswith("review/") for ref in images) and any(ref.startswith("images/") for ref in images)
    assert broken_references(lane_run.run_dir) == []


def test_the_link_check_sees_a_missing_image(lane_run: SharedRun, tmp_path: Path) -> None:
    """The broken variant of the test above: remove one image the page references."""
    run_dir = copy_run(lane_run.run_dir, tmp_path / "run")
    first_image = next(ref for tag, ref in parse_page(run_dir).references if tag == "img")
    (run_dir / unquote(first_image)).unlink()
    assert broken_references(run_dir) == [f"img {first_image}: no such file in the run directory"]


def test_sections_come_in_review_order_and_the_page_names_the_run(lane_run: SharedRun) -> None:
    page = parse_page(lane_run.run_dir)
    positions = [page.ids.index(anchor) for anchor in SECTION_ORDER]
    assert positions == sorted(positions)
    assert page.title == f"parity review: {lane_run.run_dir.name}"
    summary = page.tables["summary-table"]
    assert summary[0][:6] == ["suite", "cases", "pass", "fail", "tie_flip", "error"]
    suites = {row[0] for row in summary[1:]}
    assert set(read_results(lane_run.run_dir)["suite"]) == suites
    environment = dict(page.tables["environment"][1:])
    assert environment["torch"] and environment["device"] == "cpu" and environment["git_sha"]


def _inject_failures(run_dir: Path) -> None:
    """Append failing rows (an injected defect, not a stand-in for a suite)."""
    sites = ["layer.0", "layer.1", "layer.2", "layer.3"]
    values = [0.0, 2e-6, 4e-4, 9e-4]  # diverges at layer.2
    writer_for(run_dir).write_many(
        [
            dict(
                suite="numerics",
                case="injected-divergence",
                mode="compiled",
                site=site,
                metric="max_abs",
                value=value,
                threshold=1e-5,
                verdict="fail" if value > 1e-5 else "pass",
                better="lower",
                detail=f"injected <{site}>",
            )
            for site, value in zip(sites, values)
        ]
        + [
            dict(
                suite="zz_last",
                case="<script>alert(1)</script>",
                metric="m & n",
                value=1.0,
                threshold=0.5,
                verdict="error",
                detail="raised <b>ValueError</b>",
            ),
        ]
    )


def test_failing_rows_come_first_and_text_is_escaped(lane_run: SharedRun, tmp_path: Path) -> None:
    run_dir = copy_run(lane_run.run_dir, tmp_path / "run")
    _inject_failures(run_dir)
    page = rebuild(run_dir)
    summary = page.tables["summary-table"]
    assert [row[0] for row in summary[1:3]] == ["zz_last", "numerics"]  # error first, then fail, whatever the name
    failing = page.tables["failing-rows"]
    assert [row[0] for row in failing[1:]] == ["error", "fail", "fail"]
    assert [row[4] for row in failing[2:]] == ["layer.3", "layer.2"]  # nearest-to-bound first: furthest past it
    divergence = {row[0]: row for row in page.tables["numerics-divergence"][1:]}
    assert divergence["injected-divergence"][3] == "layer.2"  # the first failing site in forward order
    text = (run_dir / PAGE_FILE).read_text()
    assert "<script>alert(1)</script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "raised &lt;b&gt;ValueError&lt;/b&gt;" in text and 'class="status failed"' in text
    assert broken_references(run_dir) == []


def _sections(text: str) -> list[str]:
    return re.findall(r'<section id="([^"]+)">', text)


def _nav_links(text: str) -> list[str]:
    nav = re.search(r"<nav>(.*?)</nav>", text, re.S).group(1)
    return re.findall(r'href="#([^"]+)"', nav)


def test_absent_suites_leave_out_their_views_without_a_crash(lane_run: SharedRun, tmp_path: Path) -> None:
    """A run of the self-checks alone: no suite-specific view, and no link to one; files missing too."""
    run_dir = copy_run(lane_run.run_dir, tmp_path / "run")
    frame = read_results(run_dir)
    write_rows(run_dir, frame[frame["suite"] == "selfcheck"])
    for png in (run_dir / "images").rglob("*.png") if (run_dir / "images").exists() else []:
        png.unlink()
    (run_dir / "run.json").unlink()  # a run directory copied without its environment file
    page = rebuild(run_dir)
    assert dict(page.tables["environment"][1:])["rows: torch_version"]
    text = (run_dir / PAGE_FILE).read_text()
    assert _sections(text) == ["summary", "baseline", "rows", "environment"]
    links = _nav_links(text)
    assert not set(VIEW_ANCHORS) & set(links) and "rows-selfcheck" in links
    assert [row[0] for row in page.tables["summary-table"][1:]] == ["selfcheck"]
    assert broken_references(run_dir) == []


def test_suites_come_from_the_rows(lane_run: SharedRun, tmp_path: Path) -> None:
    """A suite the page has never heard of is listed (summary, navigation, all rows); a view appears
    as soon as its suite has rows, and only then."""
    run_dir = copy_run(lane_run.run_dir, tmp_path / "run")
    frame = read_results(run_dir)
    write_rows(run_dir, frame[frame["suite"].isin(["selfcheck", "routing"])])
    writer_for(run_dir).write_many(
        [dict(suite="my_new_suite", case="case-a", metric="widgets_out_of_place", value=0, threshold=0, verdict="pass")]
    )
    page = rebuild(run_dir)
    text = (run_dir / PAGE_FILE).read_text()
    assert _sections(text) == ["summary", "baseline", "routing", "rows", "environment"]
    assert {row[0] for row in page.tables["summary-table"][1:]} == {"selfcheck", "routing", "my_new_suite"}
    links = _nav_links(text)
    assert {"rows-my_new_suite", "rows-routing", "rows-selfcheck", "routing"} <= set(links)
    assert not {"numerics", "recompiles", "images", "sensitivity"} & set(links)
    assert 'id="rows-my_new_suite"' in text
    assert broken_references(run_dir) == []


def test_model_suite_sections_show_their_content(lane_run: SharedRun) -> None:
    """Numerics plots, the recompile ledger, image scores and side-by-side images, routing, sensitivity."""
    page = parse_page(lane_run.run_dir)
    frame = read_results(lane_run.run_dir)
    images = [ref for tag, ref in page.references if tag == "img"]
    assert any(re.fullmatch(r"review/numerics-(ar|dit)\.png", ref) for ref in images)
    ledger = page.tables["recompile-ledger"]
    header = ledger[0]
    assert header[:2] == ["shape", "mode"] and {"compiles", "new_compiles", "bound", "verdict", "reason"} <= set(header)
    recompiles = frame[frame["suite"] == "recompiles"]
    ledger_rows = recompiles[recompiles["metric"].map(lambda m: split_metric(m)[0] in ("compiles", "new_compiles", "recompiles"))]
    shapes = ledger_rows["case"].unique().tolist()
    assert list(dict.fromkeys(row[0] for row in ledger[1:])) == shapes  # a shape has a line per code object
    reasons = ledger_rows["detail"]
    ledger_text = " ".join(row[header.index("reason")] for row in ledger[1:])
    assert all(reason in ledger_text for reason in reasons if reason)
    scores = page.tables["image-scores"]
    assert scores[0][:7] == ["case", "pair", "verdict", "psnr", "psnr_bound", "ssim", "ssim_bound"]
    cases = sorted(p.name for p in (lane_run.run_dir / "images").iterdir())
    for case in cases:
        variants = [Path(unquote(ref)).stem for ref in images if ref.startswith(f"images/{case}/")]
        assert variants[:3] == ["reference", "serving_eager", "serving_compiled"]
        assert any(ref.startswith("review/image-diff-") and case in unquote(ref) for ref in images)
    assert len(page.tables["routing-audit"]) - 1 == frame.loc[frame["suite"] == "routing", "case"].nunique()
    sensitivity = frame[frame["suite"] == "sensitivity"]
    assert len(page.tables["sensitivity-table"]) - 1 == int(
        (sensitivity["metric"] == "killed").sum()
    )  # one line per mutant, controls in the headline


def test_the_page_shows_the_baseline_comparison(lane_run: SharedRun, tmp_path: Path) -> None:
    from parity.report.baseline import write_baseline

    run_dir = copy_run(lane_run.run_dir, tmp_path / "run")
    frame = read_results(run_dir)
    base = write_baseline(frame, tmp_path / "base.csv")
    gates = frame[(frame["kind"] != "info") & (frame["verdict"] == "pass")]
    frame.loc[gates.index[0], ["verdict", "value"]] = ["fail", frame.loc[gates.index[0], "threshold"] * 3]
    write_rows(run_dir, frame)
    write_page(load_review(run_dir, baseline=base))
    page = parse_page(run_dir)
    regressions = page.tables["regressions"]
    assert len(regressions) == 2 and regressions[1][-1] == "verdict pass -> fail"


def test_the_ledger_reads_compile_watch_metric_names(lane_run: SharedRun, tmp_path: Path) -> None:
    """parity.observe.compile_ledger names its rows per code object: `compiles[TransformerBlock.forward]`."""
    run_dir = copy_run(lane_run.run_dir, tmp_path / "run")
    frame = read_results(run_dir)
    write_rows(run_dir, frame[frame["suite"] != "recompiles"])
    reason = "tensor 'x' size mismatch at index 2. expected 32, actual 64"
    writer_for(run_dir).write_many(
        [
            dict(
                suite="recompiles",
                case="latent=32x32",
                mode="compiled",
                metric="compiles[TransformerBlock.forward]",
                value=1,
                threshold=1,
                verdict="pass",
                better="equal",
                detail="recompile reasons: none",
            ),
            dict(
                suite="recompiles",
                case="latent=32x64",
                mode="compiled",
                metric="compiles[TransformerBlock.forward]",
                value=2,
                threshold=1,
                verdict="fail",
                better="equal",
                detail=f"recompile reasons: {reason}",
            ),
            dict(
                suite="recompiles",
                case="latent=32x64",
                mode="compiled",
                metric="recompiles[TransformerBlock.forward]",
                value=1,
                verdict="pass",
                kind="info",
                detail=reason,
            ),
            dict(
                suite="recompiles",
                case="latent=32x64",
                mode="compiled",
                metric="graph_breaks",
                value=0,
                threshold=0,
                verdict="pass",
                detail="none",
            ),
        ]
    )
    page = rebuild(run_dir)
    ledger = page.tables["recompile-ledger"]
    assert ledger[0] == ["shape", "mode", "code", "compiles", "recompiles", "bound", "verdict", "reason"]
    assert [row[:5] for row in ledger[1:]] == [
        ["latent=32x32", "compiled", "TransformerBlock.forward", "1", ""],
        ["latent=32x64", "compiled", "TransformerBlock.forward", "2", "1"],
    ]
    assert ledger[2][6] == "fail" and reason in ledger[2][7]

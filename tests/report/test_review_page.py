"""index.html from a real tiny run: every link and image exists, sections in review order, failing
rows first, escaping, suites discovered from the rows (a suite-specific view only when its suite
has rows, any suite name listed), and no crash on absent suites or files."""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from parity.report import read_results
from parity.report.page import PAGE_FILE, SUITE_VIEWS, write_page
from parity.report.review import load_review
from parity.report.views import split_metric
from tests.support.shared_run import SharedRun, copy_run, write_rows, writer_for

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
    ran = frame[frame["verdict"] != "skip"]  # a grid point that only skipped is in the section's skip lines
    assert len(page.tables["routing-audit"]) - 1 == ran.loc[ran["suite"] == "routing", "case"].nunique()
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


# ---------------------------------------------------------------------------------------------
# A page sized to the target (hand-made rows: seconds, no shared run)
# ---------------------------------------------------------------------------------------------

DIT_REASON = "target 'engine-example' provides no DiT (no load_dit, build_dit): the dit suites do not apply"
ROUTER_REASON = "target 'engine-example' provides no router (no router): the routing suites do not apply"
GRAPH_REASON = "cuda_graph needs --device cuda"


def hand_made_run(run_dir: Path, rows: list[dict]) -> PageParser:
    """A run directory holding `rows` (an engine's AR-only target), its page built."""
    from parity.report import ReportWriter

    run_dir.mkdir(parents=True, exist_ok=True)
    context = dict(run_id=run_dir.name, target="engine-example", device="cpu", dtype="float32", size="tiny")
    ReportWriter(run_dir, context).write_many(rows)
    return rebuild(run_dir)


def numerics_row(case: str, site: str, value: float, verdict: str = "pass") -> dict:
    return dict(
        suite="numerics", case=case, mode="eager", site=site, metric="max_abs", value=value, threshold=1e-5, verdict=verdict
    )


def skip_row(suite: str, case: str, reason: str, mode: str | None = None) -> dict:
    return dict(suite=suite, case=case, mode=mode, metric="skipped", verdict="skip", kind="info", better="", detail=reason)


# What the plugin's family rows carry as data (parity.suites.conftest): the family's name and the members the target lacks.
FAMILY_DATA = {"dit": {"what": "DiT", "missing": ["load_dit", "build_dit"]}, "routing": {"what": "router", "missing": ["router"]}}


def family_row(suite: str, family: str, tests: int | None, reason: str) -> dict:
    return dict(
        suite=suite,
        case=family,
        metric="family_not_provided",
        value=tests,
        verdict="skip",
        kind="info",
        better="",
        detail=reason,
        data=FAMILY_DATA.get(family),
    )


AR_ROWS = [numerics_row("ar-prompt", site, value) for site, value in (("layer.0", 1e-7), ("layer.1", 2e-7), ("logits", 3e-7))]


def _text(page_dir: Path) -> str:
    return (page_dir / PAGE_FILE).read_text()


def _section(text: str, anchor: str) -> str:
    start = text.index(f'<section id="{anchor}">')
    return text[start : text.index("</section>", start)]


def _lines(html_text: str, klass: str) -> list[str]:
    return [
        html.unescape(re.sub(r"<[^>]+>", "", line))
        for line in re.findall(rf'<p class="[^"]*{klass}[^"]*"[^>]*>(.*?)</p>', html_text)
    ]


def test_an_ar_only_run_of_old_skip_rows_lists_no_skip_row_in_a_table(tmp_path: Path) -> None:
    """An AR-only target in a run written before family rows: 13 dit skip rows in numerics, 623 in
    routing. Numerics shows only what ran, with the skips one line per reason; routing is one line."""
    rows = AR_ROWS + [skip_row("numerics", f"dit-{i}", DIT_REASON) for i in range(13)]
    rows += [skip_row("numerics", "ar-prompt", GRAPH_REASON, mode="cuda_graph")]
    rows += [skip_row("routing", f"grid-{i}", ROUTER_REASON) for i in range(623)]
    page = hand_made_run(tmp_path / "run", rows)
    text = _text(tmp_path / "run")
    for rows_of_table in page.tables.values():
        assert not any("skipped" in row or any(cell.startswith("dit-") for cell in row) for row in rows_of_table), rows_of_table
    divergence = page.tables["numerics-divergence"]
    assert [row[0] for row in divergence[1:]] == ["ar-prompt"] and divergence[1][2] == "pass"
    assert _lines(_section(text, "numerics"), "skip-reason") == [
        f"13 tests skipped: {DIT_REASON}",
        f"1 test skipped: {GRAPH_REASON}",
    ]
    routing = _section(text, "routing")
    assert _lines(routing, "skip-reason") == [f"nothing ran: 623 tests skipped: {ROUTER_REASON}"]
    assert "grid points" not in routing and "<table" not in routing  # one line, no empty audit
    assert "routing-audit" not in page.tables
    skipped = page.tables["skipped-rows"]  # the summary groups them: one line per suite and reason
    assert skipped[1:] == [["numerics", "13", DIT_REASON], ["numerics", "1", GRAPH_REASON], ["routing", "623", ROUTER_REASON]]
    assert "623 skipped" in re.search(r'id="rows-routing".*?</details>', text, re.S).group(0)
    assert broken_references(tmp_path / "run") == []


def test_an_absent_family_is_one_line_at_the_top_and_in_no_table(tmp_path: Path) -> None:
    """The plugin's `family_not_provided` rows: one line per family, no view, no table row."""
    rows = AR_ROWS + [
        family_row(suite, "dit", tests, DIT_REASON)
        for suite, tests in (("recompiles", 4), ("numerics", 13), ("image", 6), ("sampler", None))
    ]
    rows += [family_row("routing", "routing", 623, ROUTER_REASON)]
    page = hand_made_run(tmp_path / "run", rows)
    text = _text(tmp_path / "run")
    block = re.search(r'<div id="not-provided">(.*?)</div>', text, re.S)
    assert block, "no line for the families the target does not provide"
    assert _lines(block.group(1), "family") == [
        "DiT: not provided by this target (no load_dit, build_dit): suites recompiles, numerics, image, sampler not run (23 tests)",
        "Router: not provided by this target (no router): suite routing not run (623 tests)",
    ]
    assert text.index('id="not-provided"') < text.index('<section id="summary">')  # near the top
    for rows_of_table in page.tables.values():
        assert not any("family_not_provided" in row or "dit" in row or "routing" in row for row in rows_of_table), rows_of_table
    assert _sections(text) == ["summary", "baseline", "numerics", "rows", "environment"]  # no routing, image, recompiles view
    assert [row[0] for row in page.tables["summary-table"][1:]] == ["numerics"]
    assert not {"rows-image", "rows-routing", "rows-recompiles", "rows-sampler"} & set(_nav_links(text))
    assert "skipped-rows" not in page.tables
    assert broken_references(tmp_path / "run") == []


def test_the_family_check_sees_a_family_row_in_a_table(tmp_path: Path, monkeypatch) -> None:
    """The broken variant: a page that reads family rows as skipped tests has no line for the family
    and a view and rows for its suite, which the checks above refuse."""
    from parity.report import sections

    monkeypatch.setattr(sections, "family_rows", lambda frame: frame.iloc[0:0])
    hand_made_run(tmp_path / "run", AR_ROWS + [family_row("routing", "routing", 623, ROUTER_REASON)])
    text = _text(tmp_path / "run")
    assert 'id="not-provided"' not in text
    assert "routing" in _sections(text) and "rows-routing" in _nav_links(text)  # a view and rows for a family not run


def test_the_skip_check_sees_skip_rows_listed_row_by_row(tmp_path: Path, monkeypatch) -> None:
    """The broken variant: a page that reads skip rows as rows that ran lists them in its tables and
    counts them in the routing header."""
    from parity.report import sections, views

    for module in (sections, views):
        monkeypatch.setattr(module, "split_skipped", lambda rows: (rows, rows.iloc[0:0]))
    rows = (
        AR_ROWS
        + [skip_row("numerics", "dit-0", DIT_REASON)]
        + [skip_row("routing", f"grid-{i}", ROUTER_REASON) for i in range(5)]
    )
    page = hand_made_run(tmp_path / "run", rows)
    assert any(row[0] == "dit-0" for row in page.tables["numerics-divergence"])
    assert "5 grid points: 0 failing, 0 with tie flips only, 0 passing" in _text(tmp_path / "run")


# ---------------------------------------------------------------------------------------------
# The decode view
# ---------------------------------------------------------------------------------------------

REFERENCE_TOKENS = [5, 9, 9, 12, 40, 41, 7, 7]
TARGET_TOKENS = [5, 9, 9, 12, 77, 3, 3, 3]  # diverges at step 4
STEP_ERRORS = [1e-7, 2e-7, 1e-7, 3e-7, 4e-2, 5e-2, 6e-2, 6e-2]


def decode_rows(
    case: str, target: list[int], errors: list[float], *, verdict: str, matched: int, tokens_rows: bool = True
) -> list[dict]:
    where = dict(suite="decode", case=case, mode="eager")
    steps = len(REFERENCE_TOKENS)
    detail = (
        f"all {steps} greedy tokens of 1 row(s) equal the reference's"
        if matched == steps
        else f"row 0 step {matched}: reference {REFERENCE_TOKENS[matched]} vs target {target[matched]}, top-2 margin 3.1 (fail)"
    )
    rows = [dict(where, metric="matched_steps", value=matched, threshold=steps, verdict=verdict, better="higher", detail=detail)]
    if tokens_rows:
        rows += [
            dict(
                where,
                site=side,
                metric="tokens",
                value=steps,
                verdict=verdict,
                kind="info",
                better="",
                detail="row 0: " + " ".join(map(str, seq)),
                data={"tokens": [seq]},
            )
            for side, seq in (("reference", REFERENCE_TOKENS), ("target", target))
        ]
    failing_at = next((i for i, e in enumerate(errors) if e > 1e-3), None)
    for first in range(0, steps, 4):
        bucket = errors[first : first + 4]
        bucket_verdict = "fail" if failing_at is not None and first + 3 >= failing_at else "pass"
        site = f"teacher_forced.steps.{first}-{first + 3}"
        rows += [
            dict(
                where,
                site=site,
                metric="rmse_vs_golden",
                value=max(bucket) / 2,
                threshold=1e-3,
                verdict=bucket_verdict,
                bound="measured",
            ),
            dict(where, site=site, metric="max_abs", value=max(bucket), verdict=bucket_verdict, kind="info", better="lower"),
        ]
    rows.append(
        dict(where, site="teacher_forced", metric="compared_steps", value=steps, threshold=steps, verdict="pass", better="equal")
    )
    rows.append(
        dict(
            where,
            site="teacher_forced",
            metric="step_max_abs",
            value=max(errors),
            verdict="fail" if failing_at is not None else "pass",
            kind="info",
            better="lower",
            detail=f"largest |target - reference| of the step logits per step, steps 0-{steps - 1}: "
            + " ".join(f"{e:.3g}" for e in errors),
            data={"steps": errors},
        )
    )
    return rows


def test_a_decode_failure_shows_its_step_both_sequences_and_the_plot(tmp_path: Path) -> None:
    rows = decode_rows("diverges", TARGET_TOKENS, STEP_ERRORS, verdict="fail", matched=4)
    rows += decode_rows("agrees", REFERENCE_TOKENS, [1e-7] * 8, verdict="pass", matched=8)
    page = hand_made_run(tmp_path / "run", AR_ROWS + rows)
    text = _text(tmp_path / "run")
    decode = _section(text, "decode")
    assert "2 decode runs (case, mode): 1 failing, 0 with tie flips only, 1 passing." in decode
    assert _lines(decode, "decode-divergence") == ["tokens diverged at step 4 of 8 (the first 4 tokens equal the reference's)"]
    tokens = page.tables["decode-tokens-0"]
    assert tokens[1] == ["target", "0", " ".join(map(str, TARGET_TOKENS))]
    assert tokens[2] == ["reference", "0", " ".join(map(str, REFERENCE_TOKENS))]
    marked = re.findall(r"<mark>(\d+)</mark>", decode)
    assert marked == ["77", "3", "3", "3", "40", "41", "7", "7"]  # from the divergence on, in both rows
    failing = page.tables["decode-failing-0"]  # the failing gate rows of the case
    assert {(row[1], row[2]) for row in failing[1:]} == {("", "matched_steps"), ("teacher_forced.steps.4-7", "rmse_vs_golden")}
    plot = re.search(r'<img src="(review/decode-diverges-eager\.png)"', decode)
    assert plot and (tmp_path / "run" / plot.group(1)).is_file()
    passing = page.tables["decode-runs"]
    assert passing[0] == ["case", "mode", "verdict", "steps_matched", "diverged_at", "largest_step_diff", "detail"]
    assert passing[1:] == [
        ["agrees", "eager", "pass", "8 of 8", "", "1e-07", "all 8 greedy tokens of 1 row(s) equal the reference's"]
    ]
    assert broken_references(tmp_path / "run") == []


def test_the_decode_plot_and_step_are_read_from_the_rows(tmp_path: Path, monkeypatch) -> None:
    """The broken variant: the same checks fail when the page takes the wrong step (a plot
    without the divergence line) or when the sequences are not drawn."""
    from parity.report import decode_view

    drawn = []
    real = decode_view.decode_step_plot
    monkeypatch.setattr(
        decode_view,
        "decode_step_plot",
        lambda series, path, title, at=None: drawn.append((series, at)) or real(series, path, title, at),
    )
    hand_made_run(tmp_path / "ok", AR_ROWS + decode_rows("diverges", TARGET_TOKENS, STEP_ERRORS, verdict="fail", matched=4))
    ((label, values),), at = drawn[0]
    assert at == 4 and values == STEP_ERRORS and "per step" in label

    monkeypatch.setattr(decode_view.DecodeRun, "tokens", property(lambda self: {}))
    page = hand_made_run(
        tmp_path / "broken", AR_ROWS + decode_rows("diverges", TARGET_TOKENS, STEP_ERRORS, verdict="fail", matched=4)
    )
    assert "decode-tokens-0" not in page.tables  # the assertion of the test above goes red


def test_a_decode_run_without_token_rows_says_what_it_lacks(tmp_path: Path) -> None:
    """A decode run without its `tokens` / `step_max_abs` rows (its test stopped before writing
    them): the step from matched_steps, and a note each for the sequences and the plot; the
    teacher-forced buckets are not spread into a per-step plot."""
    rows = [
        r
        for r in decode_rows("cut", TARGET_TOKENS, STEP_ERRORS, verdict="fail", matched=4, tokens_rows=False)
        if r["metric"] != "step_max_abs"
    ]
    page = hand_made_run(tmp_path / "run", AR_ROWS + rows)
    decode = _section(_text(tmp_path / "run"), "decode")
    assert _lines(decode, "decode-divergence") == ["tokens diverged at step 4 of 8 (the first 4 tokens equal the reference's)"]
    assert "token sequences not recorded in this run" in decode and "decode-tokens-0" not in page.tables
    assert "no per-step error of the step logits to plot" in decode and "review/decode-cut-eager.png" not in decode


def test_the_page_reads_the_decode_suites_token_and_step_rows(tmp_path: Path) -> None:
    """The decode suite writes `tokens` and `step_max_abs` payloads as the rows' data
    (parity.suites.ar.test_decode); the page reads them back as numbers, never from the detail: a
    change of either side alone goes red here."""
    import torch

    from parity.report import ReportWriter
    from parity.report.decode_view import DecodeRun
    from parity.suites.ar.decode import step_errors

    tokens = torch.tensor([[5, 9, 300], [7, 0, 12]])
    want = torch.zeros(2, 3, 4)
    have = want.clone()
    have[0, 1, 2], have[1, 2, 0] = 2.5e-3, float("nan")
    errors = step_errors(want, have)
    writer = ReportWriter(tmp_path, {})
    where = dict(suite="decode", case="c", mode="eager", kind="info", verdict="pass", detail="(prose the page never parses)")
    writer.write(dict(where, site="target", metric="tokens", value=3, data={"tokens": tokens.tolist()}))
    writer.write(dict(where, site="teacher_forced", metric="step_max_abs", value=max(errors), data={"steps": errors}))
    run = DecodeRun("c", "eager", read_results(tmp_path))
    assert run.tokens == {"target": tokens.tolist()}
    assert run.step_errors() == ("teacher-forced, largest |d| per step", errors)
    assert errors[0] == 0.0 and errors[1] == pytest.approx(2.5e-3) and errors[2] == float("inf")  # NaN read as inf

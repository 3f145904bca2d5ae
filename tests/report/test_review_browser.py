"""index.html in a real browser: headless Chromium opens the page from disk (no server, no network),
and the rendered DOM has the title, the summary table and images that actually loaded; a
screenshot is taken and is not blank; a hand-made AR-only run renders its absent families as lines,
a routing section that only skipped as one line, and its decode failure with both sequences and
the plot; a localised failure renders "Where it diverges" (the blamed stage, the stage table, the
plot loaded, the repro link), which a passing run does not have.

Needs Debian's `chromium` package (`.ci/run` installs it); skipped with a reason when no Chromium
binary exists. `PARITY_CHROMIUM` names another binary.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest

from parity.report.page import PAGE_FILE
from tests.report.test_review_page import PageParser
from tests.support.helpers import run_command
from tests.support.shared_run import SharedRun, copy_run

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Headless, sandbox off (CI runs as root), and everything that would reach the network switched off.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=10000",  # the page's load handler has run before the DOM is dumped
)


def chromium_binary() -> str | None:
    named = os.environ.get("PARITY_CHROMIUM")
    if named:
        return named
    return next((path for path in map(shutil.which, CHROMIUM_NAMES) if path), None)


pytestmark = pytest.mark.skipif(
    chromium_binary() is None,
    reason=f"no Chromium binary ({', '.join(CHROMIUM_NAMES)} not on PATH, PARITY_CHROMIUM unset): apt-get install -y chromium",
)


def chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    command = [chromium_binary(), *FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()]
    result = run_command(command)
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result


def rendered_dom(run_dir: Path, tmp_path: Path) -> str:
    return chromium(run_dir / PAGE_FILE, tmp_path / "profile-dom", "--dump-dom").stdout


def body_counts(dom: str) -> tuple[int, int]:
    """(images loaded, images on the page) as the page's load handler wrote them on <body>."""
    body = re.search(r"<body[^>]*>", dom)
    assert body, "no <body> in the rendered DOM"
    loaded = re.search(r'data-images-loaded="(\d+)"', body.group(0))
    total = re.search(r'data-images-total="(\d+)"', body.group(0))
    assert loaded and total, f"the page's load handler did not run: {body.group(0)}"
    return int(loaded.group(1)), int(total.group(1))


def test_the_rendered_page_has_its_title_summary_table_and_loaded_images(lane_run: SharedRun, tmp_path: Path) -> None:
    dom = rendered_dom(lane_run.run_dir, tmp_path)
    parsed = PageParser()
    parsed.feed(dom)
    assert parsed.title == f"parity review: {lane_run.run_dir.name}"
    assert "summary-table" in parsed.tables and len(parsed.tables["summary-table"]) > 1
    loaded, total = body_counts(dom)
    assert total >= 1 and loaded == total


def test_the_screenshot_is_not_blank(lane_run: SharedRun, tmp_path: Path) -> None:
    from PIL import Image

    shot = tmp_path / "page.png"
    chromium(lane_run.run_dir / PAGE_FILE, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1280,2400")
    assert shot.is_file()
    with Image.open(shot) as image:
        pixels = np.asarray(image.convert("RGB"))
    assert pixels.shape[:2] == (2400, 1280)
    # Text, tables and figures: far more than a blank page's one or two colours.
    assert pixels.std() > 10 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 100


def test_a_missing_image_shows_in_the_rendered_page(lane_run: SharedRun, tmp_path: Path) -> None:
    """The broken variant: the same checks see an image that does not load."""
    run_dir = copy_run(lane_run.run_dir, tmp_path / "run")
    parsed = PageParser()
    parsed.feed((run_dir / PAGE_FILE).read_text())
    first_image = next(ref for tag, ref in parsed.references if tag == "img")
    (run_dir / unquote(first_image)).unlink()
    dom = rendered_dom(run_dir, tmp_path)
    loaded, total = body_counts(dom)
    assert loaded == total - 1
    assert "1 image(s) failed to load" in dom


def test_an_ar_only_page_with_a_decode_failure_renders_its_lines_and_plot(tmp_path: Path) -> None:
    """A hand-made AR-only run (families left out, old skip rows, a diverged decode): the rendered
    page has one line per absent family, the routing section as one line, the decode step, both
    sequences and the decode plot loaded."""
    from tests.report.test_review_page import (
        AR_ROWS,
        DIT_REASON,
        REFERENCE_TOKENS,
        ROUTER_REASON,
        STEP_ERRORS,
        TARGET_TOKENS,
        decode_rows,
        family_row,
        hand_made_run,
        skip_row,
    )

    rows = AR_ROWS + decode_rows("diverges", TARGET_TOKENS, STEP_ERRORS, verdict="fail", matched=4)
    rows += [family_row(suite, "dit", 3, DIT_REASON) for suite in ("recompiles", "numerics", "image", "sampler")]
    rows += [skip_row("routing", f"grid-{i}", ROUTER_REASON) for i in range(623)]
    run_dir = tmp_path / "run"
    hand_made_run(run_dir, rows)
    dom = rendered_dom(run_dir, tmp_path)
    parsed = PageParser()
    parsed.feed(dom)
    assert "DiT: not provided by this target (no load_dit, build_dit): suites recompiles, numerics, image, sampler not run" in dom
    routing = re.search(r'<section id="routing">(.*?)</section>', dom, re.S).group(1)
    assert "nothing ran: 623 tests skipped" in routing and "<table" not in routing
    decode = re.search(r'<section id="decode">(.*?)</section>', dom, re.S).group(1)
    assert "tokens diverged at step 4 of 8" in decode
    tokens = parsed.tables["decode-tokens-0"]
    assert [row[0] for row in tokens[1:]] == ["target", "reference"]
    assert [row[2] for row in tokens[1:]] == [" ".join(map(str, TARGET_TOKENS)), " ".join(map(str, REFERENCE_TOKENS))]
    assert "review/decode-diverges-eager.png" in decode
    loaded, total = body_counts(dom)
    assert total >= 2 and loaded == total  # the numerics plot and the decode plot


def test_a_localised_failure_renders_where_it_diverges_and_a_passing_run_does_not(tmp_path: Path) -> None:
    """A hand-made run whose failing case carries a stage chain (tests/support/stage_rows.py): the
    rendered section names the blamed stage, highlights its row of the stage table, links the repro
    and its plot loads; the same page of a passing run has no such section and no link to it."""
    from tests.report.test_review_page import AR_ROWS
    from tests.report.test_review_stages import REPRO, localised_rows, run_with

    run_dir = run_with(tmp_path / "failing", localised_rows(layers=4))
    dom = rendered_dom(run_dir, tmp_path)
    parsed = PageParser()
    parsed.feed(dom)
    section = re.search(r'<section id="localise">(.*?)</section>', dom, re.S)
    assert section, "no 'Where it diverges' section in the rendered page"
    section = section.group(1)
    assert "Where it diverges" in section and "First diverging stage: <b>layer.0.q_rope</b>" in section
    stages = parsed.tables["stages-0"]
    assert [row[1] for row in stages if len(row) > 3 and row[3] == "first diverging"] == ["layer.0.q_rope"]
    assert re.search(r'<tr class="blamed">\s*<td class="num">5</td>\s*<td>layer.0.q_rope</td>', section)
    assert f'href="{REPRO}"' in section and (run_dir / REPRO).is_file()
    plot = re.search(r'<img src="(review/stages-numerics-mixed-eager\.png)"', section)
    assert plot and not re.search(r'<img[^>]*class="broken"', section)
    loaded, total = body_counts(dom)
    assert total >= 2 and loaded == total  # the numerics plot and the stage chain's plot
    assert 'href="#localise"' in dom

    passing = run_with(tmp_path / "passing", AR_ROWS, repro=False)
    dom = rendered_dom(passing, tmp_path)
    assert 'id="localise"' not in dom and "Where it diverges" not in dom and 'href="#localise"' not in dom

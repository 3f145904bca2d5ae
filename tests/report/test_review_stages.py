"""A localised failure in the review: the stage rows a localisation writes (parity.localise.rows) are
accepted by the audit, named on the failing case's line of `parity review`, and drawn on the page
as "Where it diverges" (the blamed stage, the stage table folded per layer, the plot, the repro
link, the compile-only piece); a run without them has no such section. Hand-made runs: seconds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parity.localise import rows as localise_rows
from parity.report import ReportWriter, chains
from parity.report.baseline import load_rows
from parity.report.comparison import compare_rows
from parity.report.page import PAGE_FILE, write_page
from parity.report.review import format_review, load_review
from tests.report.test_review_page import AR_ROWS, _section, broken_references, parse_page
from tests.support.stage_rows import chain_rows, failing_gate, piece_row

REPRO = "repro/mixed-eager/repro.py"  # parity.localise.repro.case_directory's spelling


def run_with(run_dir: Path, rows: list[dict], *, repro: bool = True) -> Path:
    """A run directory holding `rows` (and the repro file the chain names), its page built."""
    run_dir.mkdir(parents=True, exist_ok=True)
    context = dict(run_id=run_dir.name, target="engine-example", device="cpu", dtype="float32", size="tiny")
    ReportWriter(run_dir, context).write_many(rows)
    if repro:
        (run_dir / REPRO).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / REPRO).write_text("print('the blamed stage, both sides')\n")
    write_page(load_review(run_dir, use_default_baseline=False))
    return run_dir


def localised_rows(layers: int = 4) -> list[dict]:
    return AR_ROWS + [failing_gate("mixed")] + chain_rows("mixed", layers=layers, repro=REPRO)


def test_the_report_layer_reads_the_metrics_the_localiser_writes() -> None:
    """The report layer cannot import parity.localise (tests/repo/test_layering.py): it repeats the names."""
    assert chains.STAGE_METRIC == localise_rows.STAGE_METRIC
    assert chains.EXACT_METRIC == localise_rows.EXACT_METRIC
    assert chains.BLAME_METRIC == localise_rows.BLAME_METRIC
    assert chains.PIECE_METRIC == localise_rows.PIECE_METRIC


# ---------------------------------------------------------------------------------------------
# The audit
# ---------------------------------------------------------------------------------------------


def test_the_audit_accepts_a_chain_beside_its_failing_gate(tmp_path: Path) -> None:
    piece = [failing_gate("mixed", mode="compiled"), piece_row("mixed", "ar.language_model.model.layers.0.self_attn")]
    run_dir = run_with(tmp_path / "run", localised_rows() + piece)
    frame = load_rows(run_dir)
    stages = frame[frame["metric"] == chains.STAGE_METRIC]
    assert {"pass", "fail", "not_applicable"} <= set(stages["verdict"])  # within, diverged, not observable
    assert stages.loc[stages["verdict"] == "not_applicable", "value"].isna().all()
    review = load_review(run_dir, use_default_baseline=False)
    assert review.audit.problems == [] and review.disagreements == []


def test_the_audit_still_refuses_a_diverged_stage_beside_passing_gates(tmp_path: Path) -> None:
    """The broken variant: the same chain under a case whose gate rows pass is a failure hidden as info."""
    rows = AR_ROWS + chain_rows("ar-prompt", repro=REPRO)
    review = load_review(run_with(tmp_path / "run", rows), use_default_baseline=False)
    lines = [p.line() for p in review.disagreements]
    assert lines and all("an info row recorded fail, but no gate row of its case is fail or error" in line for line in lines)
    assert any("first_diverging_stage" in line for line in lines) and any("@layer.0.q_rope" in line for line in lines)


# ---------------------------------------------------------------------------------------------
# `parity review`'s lines
# ---------------------------------------------------------------------------------------------


def _case_lines(text: str, case: str = "mixed") -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith(f"{case}/")]


def test_a_failing_case_is_one_line_naming_its_first_diverging_stage(tmp_path: Path) -> None:
    """`case/mode: blamed stage — metric value (bound) — repro path`, the gate row first in layer order."""
    rows = localised_rows() + [failing_gate("mixed", site="layer.1")]
    run_dir = run_with(tmp_path / "run", rows)
    text = format_review(load_review(run_dir, use_default_baseline=False))
    assert _case_lines(text) == [f"mixed/eager: layer.0.q_rope — rmse_vs_golden 0.02 (bound 1e-06) — {run_dir / REPRO}"]
    assert "ar-prompt" not in text.split("numerics:", 1)[1]  # the passing case is not listed


def test_a_case_localised_in_two_modes_is_a_line_per_mode(tmp_path: Path) -> None:
    rows = AR_ROWS + [failing_gate("mixed", mode=mode) for mode in ("eager", "compiled")]
    rows += chain_rows("mixed", mode="eager") + chain_rows("mixed", mode="compiled", blamed="layer.2.attn")
    text = format_review(load_review(run_with(tmp_path / "run", rows, repro=False), use_default_baseline=False))
    assert _case_lines(text) == [  # layer order: the divergence in layer 0 first
        "mixed/eager: layer.0.q_rope — rmse_vs_golden 0.02 (bound 1e-06)",
        "mixed/compiled: layer.2.attn — rmse_vs_golden 0.02 (bound 1e-06)",
    ]


def test_a_compile_only_piece_is_named_on_the_line(tmp_path: Path) -> None:
    piece = "ar.language_model.model.layers.0.self_attn"
    rows = AR_ROWS + [failing_gate("mixed", mode="compiled"), piece_row("mixed", piece)]
    text = format_review(load_review(run_with(tmp_path / "run", rows, repro=False), use_default_baseline=False))
    assert _case_lines(text) == [f"mixed/compiled: compiled piece {piece} — rmse_vs_golden 0.02 (bound 1e-06)"]


def test_the_line_without_a_localisation_names_the_site_and_the_rows_words(tmp_path: Path) -> None:
    rows = AR_ROWS + [failing_gate("mixed")]
    text = format_review(load_review(run_with(tmp_path / "run", rows, repro=False), use_default_baseline=False))
    assert _case_lines(text) == ["mixed/eager: @logits — rmse_vs_golden 0.02 (bound 1e-06): above noise floor"]


RULE = "the target may be at most 2x as far from the fp64 golden as the reference is, " * 3


def test_a_rule_paragraph_is_printed_once_per_suite_and_lines_stay_short(tmp_path: Path) -> None:
    """The broken variant would print the paragraph on every row (several screens for one defect)."""
    gates = [
        dict(
            failing_gate("mixed", mode=mode, site=site),
            detail=f"above noise floor; {site}: ratio=3e5 [{RULE.strip()}]",
            data={"rule": RULE.strip()},  # as a rule's verdict writes it (Verdict.rule)
        )
        for mode in ("eager", "cpu_graph", "compiled")
        for site in ("layer.2", "layer.3", "logits")
    ]
    rows = (
        AR_ROWS
        + gates
        + [
            row
            for mode in ("eager", "cpu_graph", "compiled")
            for row in chain_rows("mixed", mode=mode, blamed="layer.2.gen_mlp.down", repro=REPRO)
        ]
    )
    run_dir = run_with(tmp_path / "run", rows)
    assert sum(RULE.strip() in detail for detail in load_rows(run_dir)["detail"]) == 9  # a line per row would repeat it 9 times
    text = format_review(load_review(run_dir, use_default_baseline=False))
    assert text.count(RULE.strip()) == 1, text
    assert "  rule 1: " + RULE.strip() in text
    lines = _case_lines(text)
    assert len(lines) == 3 and all(line.startswith("mixed/") for line in lines)
    for line in lines:
        head, repro = line.rsplit(" — ", 1)
        assert len(head) <= 200 and repro == str(run_dir / REPRO), line
        assert head.endswith("layer.2.gen_mlp.down — rmse_vs_golden 0.02 (bound 1e-06, rule 1)"), line
    summary = _section((run_dir / PAGE_FILE).read_text(), "summary")  # its failing cases and failing rows
    assert summary.count(RULE.strip()) == 1 and summary.count('href="#rule-numerics-1"') == 3, summary


def test_an_error_line_says_its_cause_and_place(tmp_path: Path) -> None:
    error = dict(
        suite="numerics",
        case="mixed",
        mode="cpu_graph",
        site="",
        metric="exception",
        value=None,
        verdict="error",
        detail="CaptureError (at engine/model.py:179 in moe): host read of a tensor value while capturing forward | more",
    )
    text = format_review(load_review(run_with(tmp_path / "run", AR_ROWS + [error], repro=False), use_default_baseline=False))
    assert _case_lines(text) == [
        "mixed/cpu_graph: error — exception: CaptureError (at engine/model.py:179 in moe): host read of a tensor value "
        "while capturing forward | more"
    ]
    summary = text.split("numerics:", 1)[0]
    assert "exception: CaptureError (at engine/model.py:179 in moe): host read" in summary  # the worst column's cause


def test_a_chain_is_no_new_case_against_a_baseline(tmp_path: Path) -> None:
    """The stage rows are new rows of a case the baseline holds (a baseline never fails): not a new case."""
    baseline = load_rows(run_with(tmp_path / "base", AR_ROWS + [dict(failing_gate("mixed"), value=1e-7, verdict="pass")]))
    run = load_rows(run_with(tmp_path / "run", localised_rows()))
    comparison = compare_rows(baseline.assign(run_id="base"), run)
    assert len(comparison.new) > 70 and comparison.new_cases().empty
    fresh = load_rows(run_with(tmp_path / "fresh", localised_rows() + [failing_gate("brand-new")], repro=False))
    assert list(compare_rows(baseline, fresh).new_cases()["case"]) == ["brand-new"]


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------


def test_the_page_shows_where_a_failing_case_diverges(tmp_path: Path) -> None:
    run_dir = run_with(tmp_path / "run", localised_rows(layers=4))
    page = parse_page(run_dir)
    text = (run_dir / PAGE_FILE).read_text()
    section = _section(text, "localise")
    assert "<h2>Where it diverges</h2>" in section and "<h3>numerics / mixed / eager: fail</h3>" in section
    assert "First diverging stage: <b>layer.0.q_rope</b>" in section
    assert "first diverging stage layer.0.q_rope (q after RoPE): 0.05 (bound 1e-07) while its inputs were within bound" in section
    assert f'<a class="repro" href="{REPRO}">' in section
    stages = page.tables["stages-0"]
    assert stages[0] == ["#", "site", "stage", "status", "value", "bound", "value/bound"]
    blamed = next(row for row in stages if row[1] == "layer.0.q_rope")
    assert blamed[3] == "first diverging" and blamed[6] == "5e+05"
    assert re.search(r'<tr class="blamed"><td class="num">5</td><td>layer.0.q_rope</td>', section)
    # 4 layers of ~19 stages: layer 0 whole, the other three one line each, the stages outside the layers whole
    sites = [row[1] for row in stages[1:]]
    assert sites[0] == "embed" and sites[-3:] == ["final_norm", "lm_head", "gen_head"]
    assert [s for s in sites if s.endswith(".*")] == ["layer.1.*", "layer.2.*", "layer.3.*"]
    assert all(s.startswith("layer.0.") for s in sites[1:-6])
    folded = next(row for row in stages if row[1] == "layer.2.*")
    assert folded[2].startswith("19 stages; worst against its bound:") and folded[3] == "18 diverged, 1 not observable"
    assert next(row for row in stages if row[1] == "layer.0.gen_mlp.act")[3] == "not observable"
    plot = re.search(r'<img src="(review/stages-numerics-mixed-eager\.png)"', section)
    assert plot and (run_dir / plot.group(1)).is_file()
    assert text.index('<section id="summary">') < text.index('<section id="localise">') < text.index('<section id="baseline">')
    assert '<a href="#localise">Where it diverges</a>' in text
    assert broken_references(run_dir) == []


def test_a_short_chain_is_listed_whole(tmp_path: Path) -> None:
    run_dir = run_with(tmp_path / "run", AR_ROWS + [failing_gate("mixed")] + chain_rows("mixed", layers=1, repro=REPRO))
    stages = parse_page(run_dir).tables["stages-0"]
    assert len(stages) - 1 == 19 + 4 and not any(row[1].endswith(".*") for row in stages)


def test_the_suite_views_leave_the_stage_rows_out(tmp_path: Path) -> None:
    """The numerics view orders its sites and plots its layers from its own rows: stage sites are not layers."""
    run_dir = run_with(tmp_path / "run", localised_rows())
    page = parse_page(run_dir)
    assert [row[0] for row in page.tables["numerics-divergence"][1:]] == ["mixed", "ar-prompt"]
    assert page.tables["numerics-divergence"][1][3] == "logits"
    numerics = _section((run_dir / PAGE_FILE).read_text(), "numerics")
    assert "q_rope" not in numerics and "stage_rmse_vs_golden" not in numerics


def test_a_compile_only_piece_is_shown(tmp_path: Path) -> None:
    piece = "ar.language_model.model.layers.0.self_attn"
    run_dir = run_with(
        tmp_path / "run", AR_ROWS + [failing_gate("mixed", mode="compiled"), piece_row("mixed", piece)], repro=False
    )
    section = _section((run_dir / PAGE_FILE).read_text(), "localise")
    assert "<h3>numerics / mixed / compiled: fail</h3>" in section
    assert f"run eagerly is <code>{piece}</code>: compiled {piece} differs from the same module run eagerly" in section
    assert "stages-0" not in section and broken_references(run_dir) == []


def test_a_bisection_that_found_no_single_piece_says_so(tmp_path: Path) -> None:
    rows = AR_ROWS + [failing_gate("mixed", mode="compiled"), piece_row("mixed", None)]
    run_dir = run_with(tmp_path / "run", rows, repro=False)
    section = _section((run_dir / PAGE_FILE).read_text(), "localise")
    assert "Compile-only: no compiled piece alone differs from its eager run (2 pieces tried)" in section
    text = format_review(load_review(run_dir, use_default_baseline=False))
    assert "compiled piece" not in text and "first diverging stage" not in text


@pytest.mark.parametrize("named", ["../outside.py", "/etc/hostname", "repro/missing/repro.py"])
def test_a_repro_path_outside_the_run_or_missing_is_not_linked(tmp_path: Path, named: str) -> None:
    (tmp_path / "outside.py").write_text("print('not the run')\n")
    rows = AR_ROWS + [failing_gate("mixed")] + chain_rows("mixed", repro=named)
    run_dir = run_with(tmp_path / "run", rows, repro=False)
    section = _section((run_dir / PAGE_FILE).read_text(), "localise")
    assert 'class="repro"' not in section and f"repro {named}: no such file inside this run directory" in section
    assert broken_references(run_dir) == []


def test_a_run_without_stage_rows_has_no_such_section(tmp_path: Path) -> None:
    for name, rows in (("passing", AR_ROWS), ("failing", AR_ROWS + [failing_gate("mixed")])):
        text = (run_with(tmp_path / name, rows, repro=False) / PAGE_FILE).read_text()
        assert 'id="localise"' not in text and "Where it diverges" not in text and "review/stages-" not in text


def test_the_section_check_sees_a_page_without_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: a page that never reads the stage rows shows no section for a localised case."""
    from parity.report import sections

    monkeypatch.setattr(sections, "localised_cases", lambda frame: [])
    text = (run_with(tmp_path / "run", localised_rows()) / PAGE_FILE).read_text()
    assert 'id="localise"' not in text  # the assertions of the page test above go red


def test_beyond_the_cases_drawn_in_full_a_localised_case_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from parity.report import sections

    monkeypatch.setattr(sections, "MAX_LOCALISED", 2)
    rows = list(AR_ROWS)
    for case in ("first", "second", "third"):
        rows += [failing_gate(case)] + chain_rows(case, layers=1, blamed="layer.0.attn")
    run_dir = run_with(tmp_path / "run", rows, repro=False)
    page = parse_page(run_dir)
    section = _section((run_dir / PAGE_FILE).read_text(), "localise")
    assert section.count('<div class="localised"') == 2 and {"stages-0", "stages-1"} <= set(page.tables)
    more = page.tables["localised-more"]
    assert more[0][:4] == ["suite", "case", "mode", "first_diverging_stage"]
    assert more[1][:4] == ["numerics", "third", "eager", "layer.0.attn"]
    assert broken_references(run_dir) == []


def test_text_from_the_rows_is_escaped_on_the_page_and_plain_in_the_plot(tmp_path: Path) -> None:
    case = "<b>$x$</b> & co"
    rows = AR_ROWS + [failing_gate(case)] + chain_rows(case, layers=1)
    run_dir = run_with(tmp_path / "run", rows, repro=False)
    section = _section((run_dir / PAGE_FILE).read_text(), "localise")
    assert "<b>$x$</b>" not in section and "numerics / &lt;b&gt;$x$&lt;/b&gt; &amp; co / eager: fail" in section
    plot = re.search(r'<img src="(review/stages-numerics-[\w.-]+\.png)"', section)  # drawn: no mathtext error
    assert plot and (run_dir / plot.group(1)).is_file()


def test_a_mode_localised_alone_is_named(tmp_path: Path) -> None:
    rows = AR_ROWS + [failing_gate("mixed", mode=mode) for mode in ("eager", "compiled")] + chain_rows("mixed", mode="compiled")
    text = format_review(load_review(run_with(tmp_path / "run", rows, repro=False), use_default_baseline=False))
    assert _case_lines(text) == [
        "mixed/compiled: layer.0.q_rope — rmse_vs_golden 0.02 (bound 1e-06)",
        "mixed/eager: @logits — rmse_vs_golden 0.02 (bound 1e-06): above noise floor",
    ]

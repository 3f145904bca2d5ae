"""Bad input for `parity review` and for run directories: a results file that cannot be trusted, a
baseline that is not whole, writes that would lose data or follow a link (docs/reports.md §1-§3).

The table works as `tests/harness/test_bad_inputs.py`'s (`tests/support/bad_input_table.py`): every row makes one
mistake and names the words of the one line that explains it; each row also names the exit status
README documents for it (`EXIT`: 2 unusable input, 1 a verdict the rows contradict, 4 a `parity
run` refused before pytest). `test_the_checks_are_what_catch_these` switches each check off and
shows its rows going red (the owner checks of `parity run`: tests/report/test_safe_writes.py).
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from parity.report import RESULTS_FILE, ReportWriter, write_run_info
from parity.report.rundir import RunClaim
from tests.support.bad_input_table import Bad, Outcome, check_bad_input, cli

CONTEXT = {
    "run_id": "r",
    "target": "serving",
    "device": "cpu",
    "dtype": "fp32",
    "size": "tiny",
    "torch_version": "2.13.0+cpu",
    "tp": "1",
}
# A small run as the suites write one: lower-, higher- and equal-is-better gate rows, a measured
# bound, an info row beside a gate row, a skipped test.
ROWS = [
    {
        "suite": "numerics",
        "case": "c0",
        "metric": "rmse_vs_golden",
        "value": 1e-8,
        "threshold": 3e-8,
        "better": "lower",
        "bound": "measured",
    },
    {"suite": "numerics", "case": "c0", "metric": "cosine", "value": 0.99, "kind": "info", "better": "higher"},
    {
        "suite": "image",
        "case": "c1",
        "metric": "psnr_vs_golden",
        "value": 60.0,
        "threshold": 40.0,
        "better": "higher",
        "bound": "measured",
    },
    {"suite": "routing", "case": "c2", "metric": "ids_mismatch", "value": 0, "threshold": 0, "better": "lower"},
    {"suite": "selfcheck", "case": "c3", "metric": "killed", "value": 1, "threshold": 1, "better": "equal"},
    {
        "suite": "decode",
        "case": "c4",
        "metric": "skipped",
        "value": None,
        "verdict": "skip",
        "kind": "info",
        "better": "",
        "detail": "no GPU",
    },
]
ROW = {"verdict": "pass", "kind": "gate", "better": "lower"}


def make_run(run_dir: Path, *, rows: list[dict[str, Any]] | None = None, **info: Any) -> Path:
    """A complete run directory as the plugin writes one (run.json at the first row)."""
    run_info = {"run_id": run_dir.name, "status": "complete", "pid": os.getpid(), "host": os.uname().nodename, "seed": 0}
    run_info.update({k: CONTEXT[k] for k in ("device", "dtype", "size", "target")}, torch=CONTEXT["torch_version"])
    run_info.update(info)  # a row's own run.json values (a torch that differs from the rows) win
    writer = ReportWriter(run_dir, {**CONTEXT, "run_id": run_dir.name}, on_create=lambda d: write_run_info(d, run_info))
    for row in rows or ROWS:
        writer.write({**ROW, **row})
    return run_dir


def edit_rows(run_dir: Path, edit: Callable[[list[dict[str, str]]], None]) -> None:
    """Rewrite results.csv as text after `edit` changed its records (a hand edit, a bad tool)."""
    path = run_dir / RESULTS_FILE
    records = list(csv.DictReader(io.StringIO(path.read_text())))
    edit(records)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(records[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    path.write_text(text.getvalue())


def edited(**changes: str) -> Callable[[Path], Path]:
    """A run whose gate row `metric` (default: the first) has `changes`."""
    metric = changes.pop("row", "rmse_vs_golden")

    def prepare(tmp_path: Path) -> Path:
        def edit(records: list[dict[str, str]]) -> None:
            next(r for r in records if r["metric"] == metric).update(changes)

        run_dir = make_run(tmp_path / "run")
        edit_rows(run_dir, edit)
        return run_dir

    return prepare


def review(prepare: Callable[[Path], Path], *extra: str) -> Callable[[Path], Outcome]:
    """`parity review RUN_DIR` (no baseline unless `extra` names one); the run's rows must stay as they were."""

    def run(tmp_path: Path) -> Outcome:
        run_dir = prepare(tmp_path)
        results = run_dir / RESULTS_FILE
        before = results.read_bytes() if results.is_file() and not results.is_symlink() else None
        flags = [] if any(a.startswith("--baseline") or a == "--write-baseline" for a in extra) else ["--no-baseline"]
        outcome = cli("review", run_dir, *extra, *flags)
        outcome.preserved = None if before is None else results.read_bytes() == before
        return outcome

    return run


def joined(tmp_path: Path) -> Path:
    """Two results files concatenated: the second header is read as a row (suite "suite")."""
    run_dir = make_run(tmp_path / "run")
    other = make_run(tmp_path / "other")
    path = run_dir / RESULTS_FILE
    path.write_text(path.read_text() + (other / RESULTS_FILE).read_text())
    return run_dir


def mixed(column: str, value: str) -> Callable[[Path], Path]:
    """One row of another configuration (as an --append of another session, or a joined file, makes)."""

    def prepare(tmp_path: Path) -> Path:
        run_dir = make_run(tmp_path / "run")
        edit_rows(run_dir, lambda records: records[-1].update({column: value}))
        return run_dir

    return prepare


def run_json_says(**info: Any) -> Callable[[Path], Path]:
    return lambda tmp_path: make_run(tmp_path / "run", **info)


def hidden_fail(tmp_path: Path) -> Path:
    """A failing gate row turned into an info row (info rows never fail a review)."""
    run_dir = make_run(tmp_path / "run")
    edit_rows(
        run_dir,
        lambda records: next(r for r in records if r["metric"] == "rmse_vs_golden").update(
            {"kind": "info", "verdict": "fail", "value": "5e-8"}
        ),
    )
    return run_dir


# -- baselines --------------------------------------------------------------------------------


def baseline_made(edit: Callable[[str], str]) -> Callable[[Path], Path]:
    """A baseline of the same run (in `baselines/`), its text changed by `edit`."""

    def make(tmp_path: Path) -> Path:
        from parity.report.baseline import load_rows, write_baseline

        path = write_baseline(load_rows(make_run(tmp_path / "other")), tmp_path / "baselines" / "cpu-fp32.csv")
        path.write_text(edit(path.read_text()))
        return path

    return make


def with_baseline(make: Callable[[Path], Path]) -> Callable[[Path], Outcome]:
    def run(tmp_path: Path) -> Outcome:
        baseline = make(tmp_path)
        return review(lambda p: make_run(p / "run"), "--baseline", str(baseline))(tmp_path)

    return run


def bogus_bound(text: str) -> str:
    return re.sub(r",measured,(\w*)\n", r",bogus,\1\n", text, count=1)  # bound, then the family column


def cut_short(text: str) -> str:
    return text[: text.rstrip("\n").rfind(",")]  # the last record loses its last field and newline


def value_not_a_number(text: str) -> str:
    return text.replace(",60.0,", ",sixty,", 1)


# -- --write-baseline -------------------------------------------------------------------------


def write_baseline_to(target: Callable[[Path, Path], Path], *, before_run_dir: bool = False) -> Callable[[Path], Outcome]:
    """`parity review RUN --write-baseline PATH` (or with the option before RUN_DIR, where argparse
    reads RUN_DIR as PATH and reviews the latest run). Every file involved must be unchanged."""

    def run(tmp_path: Path) -> Outcome:
        run_dir = make_run(tmp_path / "reports" / "runs" / "r")
        path = target(tmp_path, run_dir)
        watched = [p for p in (run_dir / RESULTS_FILE, run_dir / "run.json", path) if p.is_file() and not p.is_symlink()]
        before = [p.read_bytes() for p in watched]
        args = ["review", "--write-baseline", path] if before_run_dir else ["review", run_dir, "--write-baseline", path]
        outcome = cli(*args, "--no-baseline")
        outcome.preserved = [p.read_bytes() for p in watched] == before
        return outcome

    return run


def a_results_copy(tmp_path: Path, run_dir: Path) -> Path:
    return Path(shutil.copy(run_dir / RESULTS_FILE, tmp_path / "kept-results.csv"))


def notes(tmp_path: Path, run_dir: Path) -> Path:
    path = tmp_path / "notes.csv"
    path.write_text("when,what\n2026-12-01,the numbers I need\n")
    return path


def link_to_notes(tmp_path: Path, run_dir: Path) -> Path:
    link = tmp_path / "cpu-fp32.csv"
    link.symlink_to(notes(tmp_path, run_dir))
    return link


# -- links and review/ ------------------------------------------------------------------------


def linked_run_dir(tmp_path: Path) -> Path:
    real = make_run(tmp_path / "elsewhere")
    link = tmp_path / "run"
    link.symlink_to(real)
    return link


def linked_results(tmp_path: Path) -> Path:
    run_dir = make_run(tmp_path / "run")
    other = make_run(tmp_path / "other")
    (run_dir / RESULTS_FILE).unlink()
    (run_dir / RESULTS_FILE).symlink_to(other / RESULTS_FILE)
    return run_dir


def user_files_in_review_dir(tmp_path: Path) -> Path:
    run_dir = make_run(tmp_path / "run")
    (run_dir / "review").mkdir()
    (run_dir / "review" / "my-notes.md").write_text("what I found\n")
    return run_dir


def linked_review_dir(tmp_path: Path) -> Path:
    run_dir = make_run(tmp_path / "run")
    (tmp_path / "mine").mkdir()
    (run_dir / "review").symlink_to(tmp_path / "mine")
    return run_dir


# -- parity run into a live run ---------------------------------------------------------------


def into_live_run(*args: str) -> Callable[[Path], Outcome]:
    """`parity run --run-id r ARGS` while run `r` is live (its claim held: here by this process, as
    a `parity run` in another terminal would hold it); the live run's rows are kept."""

    def run(tmp_path: Path) -> Outcome:
        run_dir = make_run(tmp_path / "reports" / "r", status="running")
        claim = RunClaim.take(run_dir)
        claim.record()
        try:
            before = (run_dir / RESULTS_FILE).read_bytes()
            outcome = cli("run", "--report-dir", tmp_path / "reports", "--run-id", "r", "--suite", "selfcheck", *args)
            outcome.preserved = (run_dir / RESULTS_FILE).read_bytes() == before
        finally:
            claim.release(keep_record=True)
        return outcome

    return run


def into_linked_run_id(tmp_path: Path) -> Outcome:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "r").symlink_to(tmp_path / "elsewhere")
    return cli("run", "--report-dir", tmp_path / "reports", "--run-id", "r", "--suite", "selfcheck")


def _forced(tmp_path: Path) -> Outcome:
    """`--force` replaces a baseline of another configuration, never a results file."""
    run_dir = make_run(tmp_path / "reports" / "runs" / "r")
    path = a_results_copy(tmp_path, run_dir)
    before = path.read_bytes()
    outcome = cli("review", run_dir, "--write-baseline", path, "--force", "--no-baseline")
    outcome.preserved = path.read_bytes() == before
    return outcome


UNUSABLE, FAILING, REFUSED_RUN = 2, 1, 4

# fmt: off
BAD_INPUTS = [
    # -- docs/reports.md §1 results.csv taken on trust: rows that are not parity rows (exit 2) ------------------
    Bad("review-verdict-unknown", review(edited(verdict="maybe")), ("results.csv line 2", "numerics/c0/eager rmse_vs_golden", "verdict 'maybe' is not one of pass, fail")),
    Bad("review-verdict-uppercase", review(edited(verdict="FAIL")), ("results.csv line 2", "verdict 'FAIL' is not one of")),
    Bad("review-verdict-empty", review(edited(verdict="")), ("results.csv line 2", "empty verdict")),
    Bad("review-kind-unknown", review(edited(kind="gateway")), ("results.csv line 2", "kind 'gateway' is not one of gate, info")),
    Bad("review-better-unknown", review(edited(better="smaller")), ("results.csv line 2", "better 'smaller' is not one of lower, higher, equal")),
    Bad("review-bound-unknown", review(edited(bound="bogus")), ("results.csv line 2", "bound 'bogus' is not one of fixed, measured")),
    Bad("review-value-not-a-number", review(edited(value="abc")), ("results.csv line 2", "value 'abc' is not a number")),
    Bad("review-threshold-not-a-number", review(edited(threshold="1e-5x")), ("results.csv line 2", "threshold '1e-5x' is not a number")),
    Bad("review-two-files-joined", review(joined), ("results.csv line 8", "the header line again: two results files joined")),
    Bad("review-several-targets", review(mixed("target", "reference")), ("results.csv line 7", "target 'reference', but line 2 says 'serving'")),
    Bad("review-several-devices", review(mixed("device", "cuda")), ("results.csv line 7", "device 'cuda', but line 2 says 'cpu'")),
    Bad("review-several-dtypes", review(mixed("dtype", "bf16")), ("results.csv line 7", "dtype 'bf16', but line 2 says 'fp32'")),
    Bad("review-several-sizes", review(mixed("size", "full")), ("results.csv line 7", "size 'full', but line 2 says 'tiny'")),
    Bad("review-several-torch-versions", review(mixed("torch_version", "2.11.0+cu130")), ("results.csv line 7", "torch_version '2.11.0+cu130'")),
    Bad("review-several-run-ids", review(mixed("run_id", "another-run")), ("results.csv line 7", "run_id 'another-run', but line 2 says 'run'")),
    Bad("review-several-tp-sizes", review(mixed("tp", "2")), ("results.csv line 7", "tp '2', but line 2 says '1'", "one run has one tp")),
    Bad("review-run-json-device", review(run_json_says(device="cuda", device_name="NVIDIA H200")), ("run.json key 'device'", "says 'cuda', but the rows say 'cpu'")),
    Bad("review-run-json-tp", review(run_json_says(tp=2)), ("run.json key 'tp'", "says 2, but the rows say '1'")),
    Bad("review-run-json-target", review(run_json_says(target="my_engine:make")), ("run.json key 'target'", "says 'my_engine:make', but the rows say 'serving'")),
    Bad("review-run-json-torch", review(run_json_says(torch="2.11.0")), ("run.json key 'torch'", "says '2.11.0', but the rows say '2.13.0+cpu'")),
    # -- docs/reports.md §1 verdicts the rows' own numbers contradict (exit 1) ---------------------------------
    Bad("review-pass-above-bound", review(edited(value="5", threshold="1")), ("results.csv line 2", "recorded pass, derived fail: value 5 against at most 1 (lower is better)")),
    Bad("review-pass-below-higher-bound", review(edited(row="psnr_vs_golden", value="20.0")), ("results.csv line 4", "image/c1/eager psnr_vs_golden", "recorded pass, derived fail: value 20 against at least 40")),
    Bad("review-pass-not-equal", review(edited(row="killed", value="0")), ("results.csv line 6", "recorded pass, derived fail: value 0 against exactly 1")),
    Bad("review-pass-nan", review(edited(value="nan")), ("results.csv line 2", "recorded pass with value nan")),
    Bad("review-pass-inf-lower", review(edited(value="inf")), ("results.csv line 2", "recorded pass with value inf", "only as +inf where higher is better")),
    Bad("review-pass-without-value", review(edited(value="")), ("results.csv line 2", "recorded pass with no value")),
    Bad("review-fail-hidden-as-info", review(hidden_fail), ("results.csv line 2", "an info row recorded fail, but no gate row of its case is fail or error")),
    Bad("review-tie-flip-not-a-decision", review(edited(verdict="tie_flip", value="5e-8")), ("results.csv line 2", "recorded tie_flip, but rmse_vs_golden is not a decision")),
    Bad("review-tie-flip-within-bound", review(edited(row="ids_mismatch", verdict="tie_flip")), ("results.csv line 5", "recorded tie_flip, derived pass")),
    Bad("review-not-applicable-with-bound", review(edited(verdict="not_applicable", value="5e-8")), ("results.csv line 2", "recorded not_applicable, but the row holds a threshold")),
    Bad("review-skip-with-bound", review(edited(verdict="skip", value="5e-8")), ("results.csv line 2", "recorded skip, but the row holds a threshold")),
    # -- docs/reports.md §1 baselines, parsed strictly (exit 2) ------------------------------------------------
    Bad("baseline-bound-bogus", with_baseline(baseline_made(bogus_bound)), ("cpu-fp32.csv line 3", "bound 'bogus' is not one of fixed, measured")),
    Bad("baseline-last-record-cut", with_baseline(baseline_made(cut_short)), ("cpu-fp32.csv line 7", "a record cut short")),
    Bad("baseline-value-not-a-number", with_baseline(baseline_made(value_not_a_number)), ("cpu-fp32.csv line 3", "value 'sixty' is not a number")),
    Bad("baseline-verdict-unknown", with_baseline(baseline_made(lambda t: t.replace(",pass,", ",passed,", 1))), ("cpu-fp32.csv line", "verdict 'passed' is not one of")),
    # -- docs/reports.md §2 --write-baseline writes exactly where told, never into a run (exit 2) --------------
    Bad("write-baseline-into-the-run", write_baseline_to(lambda tmp, run: run / RESULTS_FILE), ("--write-baseline", "inside the run directory", "never written into a run")),
    Bad("write-baseline-eats-run-dir", write_baseline_to(lambda tmp, run: run / RESULTS_FILE, before_run_dir=True), ("--write-baseline", "inside the run directory", "put RUN_DIR before --write-baseline")),
    Bad("write-baseline-run-dir-as-path", write_baseline_to(lambda tmp, run: run, before_run_dir=True), ("--write-baseline", "a directory, not a baseline file")),
    Bad("write-baseline-over-results-copy", write_baseline_to(a_results_copy), ("kept-results.csv", "a run's results file (columns run_id, time, worker, test, git_sha)", "--force or not")),
    Bad("write-baseline-over-results-forced", _forced, ("kept-results.csv", "a run's results file", "--force or not")),
    Bad("write-baseline-over-other-file", write_baseline_to(notes), ("notes.csv", "exists and is not a parity baseline")),
    Bad("write-baseline-through-link", write_baseline_to(link_to_notes), ("--write-baseline", "cpu-fp32.csv: a symbolic link")),
    # -- docs/reports.md §2: review/ is parity's; docs/reports.md §3: no write through a link (exit 2)
    Bad("review-dir-holds-user-files", review(user_files_in_review_dir), ("review: holds my-notes.md", "which parity review did not write")),
    Bad("review-dir-a-link", review(linked_review_dir), ("the page's figure directory review/ is a symbolic link",)),
    Bad("review-run-dir-a-link", review(linked_run_dir), ("the run directory is a symbolic link",)),
    Bad("review-results-a-link", review(linked_results), ("results.csv is a symbolic link",)),
    # -- docs/reports.md §2: a live run is never overwritten, appended to or shared; docs/reports.md §3: links (exit 4)
    Bad("run-overwrite-live", into_live_run("--overwrite"), ("--run-id 'r'", "is in use by a live run (process", "--overwrite would delete the rows it is writing")),
    Bad("run-append-live", into_live_run("--append"), ("--run-id 'r'", "is in use by a live run", "cannot add rows to it while it runs")),
    Bad("run-shared-with-live", into_live_run(), ("--run-id 'r'", "is in use by a live run", "two runs never share a directory")),
    Bad("run-id-a-link", into_linked_run_id, ("--run-id 'r'", "is a symbolic link", "never written through a link")),
]
# fmt: on


EXIT = {
    **{row.id: UNUSABLE for row in BAD_INPUTS if row.id.startswith(("review-", "baseline-", "write-baseline-"))},
    **{
        row.id: FAILING
        for row in BAD_INPUTS
        if row.id.startswith(("review-pass-", "review-fail-", "review-tie-", "review-not-", "review-skip-"))
    },
    **{row.id: REFUSED_RUN for row in BAD_INPUTS if row.id.startswith("run-")},
}


def test_every_row_names_its_exit_status() -> None:
    assert sorted(EXIT) == sorted(row.id for row in BAD_INPUTS)
    assert len({row.id for row in BAD_INPUTS}) == len(BAD_INPUTS)


@pytest.mark.parametrize("row", [pytest.param(row, id=row.id, marks=row.marks) for row in BAD_INPUTS])
def test_bad_input(row: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outcome = check_bad_input(row, tmp_path, monkeypatch)
    assert outcome.code == EXIT[row.id], outcome.output


def test_the_good_run_reviews_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control of every row above: the same run untouched reviews OK (exit 0), against its own
    baseline too, and a baseline may be written outside the run (and over an empty file)."""
    monkeypatch.chdir(tmp_path)
    run_dir = make_run(tmp_path / "run")
    outcome = cli("review", run_dir, "--no-baseline")
    assert outcome.code == 0 and "AUDIT" not in outcome.output, outcome.output
    baseline = baseline_made(lambda text: text)(tmp_path)
    outcome = cli("review", run_dir, "--baseline", baseline)
    assert outcome.code == 0, outcome.output
    (tmp_path / "empty.csv").write_text("")
    outcome = cli("review", run_dir, "--no-baseline", "--write-baseline", tmp_path / "empty.csv")
    assert outcome.code == 0 and "wrote baseline" in outcome.output, outcome.output


# ---------------------------------------------------------------------------------------------
# The checks are what catch these: switched off, rows of the table go red
# ---------------------------------------------------------------------------------------------


def _no_audit(patch: pytest.MonkeyPatch) -> None:
    from parity.report.audit import Audit

    patch.setattr("parity.report.review.audit_records", lambda records, info=None: Audit(records.path))


def _lenient_baselines(patch: pytest.MonkeyPatch) -> None:
    from parity.report.baseline import load_rows

    patch.setattr("parity.report.review.load_rows", lambda source, strict=False: load_rows(source))


def _any_baseline_target(patch: pytest.MonkeyPatch) -> None:
    patch.setattr("parity.report.baseline.check_baseline_target", Path)


def _any_review_dir(patch: pytest.MonkeyPatch) -> None:
    patch.setattr("parity.report.html.check_review_dir", lambda root: None)


def _follow_links(patch: pytest.MonkeyPatch) -> None:
    patch.setattr("parity.report.run_files.refuse_link", lambda *a: None)
    patch.setattr("parity.report.page.refuse_link", lambda *a: None)


def _no_tp_provenance(patch: pytest.MonkeyPatch) -> None:
    from parity.report import audit

    patch.setattr(audit, "PROVENANCE", {k: v for k, v in audit.PROVENANCE.items() if k != "tp"})


SWITCHED_OFF = {
    "review-several-tp-sizes": _no_tp_provenance,
    "review-run-json-tp": _no_tp_provenance,
    "review-verdict-unknown": _no_audit,
    "review-two-files-joined": _no_audit,
    "review-several-targets": _no_audit,
    "review-run-json-device": _no_audit,
    "review-pass-above-bound": _no_audit,
    "review-pass-nan": _no_audit,
    "review-fail-hidden-as-info": _no_audit,
    "review-tie-flip-not-a-decision": _no_audit,
    "baseline-bound-bogus": _lenient_baselines,
    "baseline-last-record-cut": _lenient_baselines,
    "write-baseline-into-the-run": _any_baseline_target,
    "write-baseline-eats-run-dir": _any_baseline_target,
    "write-baseline-over-results-copy": _any_baseline_target,
    "review-dir-holds-user-files": _any_review_dir,
    "review-run-dir-a-link": _follow_links,
    "review-results-a-link": _follow_links,
}


@pytest.mark.parametrize("row_id", sorted(SWITCHED_OFF))
def test_the_checks_are_what_catch_these(row_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check switched off (a broken variant of the harness): the row's mistake passes silently
    (exit 0), or at least no longer gives its explaining line, and data is lost where it guarded some."""
    monkeypatch.chdir(tmp_path)
    row = next(row for row in BAD_INPUTS if row.id == row_id)
    SWITCHED_OFF[row_id](monkeypatch)
    try:
        outcome = row.run(tmp_path)
    except Exception:  # the unchecked rows reached a reader that cannot take them: a traceback, no explaining line
        return
    explaining = [line for line in outcome.output.splitlines() if all(word in line for word in row.expect)]
    assert outcome.code == 0 or not explaining, outcome.output

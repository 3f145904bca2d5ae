"""Writes that cannot lose data or follow a link (docs/reports.md §2-§3).

Each behaviour is shown twice: parity's writes as they are keep the data (a planted link's target,
the old baseline, a user's file in review/, a live run's rows), and a broken variant (the write as it
was before, or the check switched off) loses it, so each test can fail.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from parity.plugin.session import RunDirError, claim_run_dir
from parity.report import RESULTS_FILE, RUN_INFO_FILE, ReportError, ReportWriter, rundir, write_run_info
from parity.report import html as html_mod
from parity.report import page as page_mod
from parity.report.baseline import BaselineError, load_rows, write_baseline
from parity.report.run_files import RunFiles, completeness
from parity.report.run_info import read_run_info
from parity.report.rundir import OWNER_FILE, RunClaim, RunInUse
from tests.harness.test_bad_inputs_review import CONTEXT, make_run
from tests.support.bad_input_table import cli
from tests.support.helpers import PROJECT_ROOT, run_pytest_in_pytester, subprocess_env

VICTIM_TEXT = "a file outside the run directory\n"


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


# ---------------------------------------------------------------------------------------------
# docs/reports.md §3 No write follows a link: index.html's and run.json's temporary files, results.csv, the run dir
# ---------------------------------------------------------------------------------------------


def _old_write_page(review) -> Path:
    """write_page as it was: a fixed temporary name, opened through whatever is there."""
    text = page_mod.render_page(review)
    path = review.run_dir / page_mod.PAGE_FILE
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


@pytest.mark.parametrize("broken", [False, True], ids=["as-is", "old-write-page"])
def test_a_link_planted_at_index_html_tmp_is_not_written_through(
    broken: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run directory received as a CI artifact carries `index.html.tmp -> somewhere`."""
    monkeypatch.chdir(tmp_path)
    run_dir = make_run(tmp_path / "run")
    target = victim(tmp_path)
    (run_dir / "index.html.tmp").symlink_to(target)
    if broken:
        monkeypatch.setattr(page_mod, "write_page", _old_write_page)
    outcome = cli("review", run_dir, "--no-baseline")
    assert outcome.code == 0, outcome.output
    kept = target.read_text() == VICTIM_TEXT
    assert kept != broken
    # The old write also moved the planted link to index.html; the page must be a file of its own.
    assert (run_dir / "index.html").is_symlink() == broken


def _old_write_run_info(run_dir: Path, info) -> None:
    import json

    path = Path(run_dir) / RUN_INFO_FILE
    partial = path.with_name(f".{RUN_INFO_FILE}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(dict(info)) + "\n")
    os.replace(partial, path)


@pytest.mark.parametrize("broken", [False, True], ids=["as-is", "old-write-run-info"])
def test_a_link_planted_at_run_jsons_temporary_file_is_not_written_through(broken: bool, tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run")
    target = victim(tmp_path)
    (run_dir / f".{RUN_INFO_FILE}.{os.getpid()}.tmp").symlink_to(target)
    (run_dir / RUN_INFO_FILE).unlink()
    (run_dir / RUN_INFO_FILE).symlink_to(tmp_path / "also-a-victim.json")
    (tmp_path / "also-a-victim.json").write_text("{}")
    (_old_write_run_info if broken else write_run_info)(run_dir, {"status": "complete"})
    assert (target.read_text() == VICTIM_TEXT) != broken
    if not broken:  # the link at run.json is replaced by the file, its target left alone
        assert not (run_dir / RUN_INFO_FILE).is_symlink() and read_run_info(run_dir) == {"status": "complete"}
        assert (tmp_path / "also-a-victim.json").read_text() == "{}"


def _old_open(self: ReportWriter):
    self.run_dir.mkdir(parents=True, exist_ok=True)
    return open(self.path, "a", newline="")


@pytest.mark.parametrize("broken", [False, True], ids=["as-is", "old-open"])
def test_rows_are_never_written_through_a_linked_results_csv_or_run_dir(
    broken: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if broken:
        monkeypatch.setattr(ReportWriter, "_open", _old_open)
    row = {"suite": "selfcheck", "case": "c", "metric": "m", "value": 0, "threshold": 1, "verdict": "pass"}
    target = victim(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / RESULTS_FILE).symlink_to(target)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "linked-run").symlink_to(elsewhere)
    for run_dir, said in ((tmp_path / "run", "results.csv: a symbolic link"), (tmp_path / "linked-run", "is a symbolic link")):
        writer = ReportWriter(run_dir, CONTEXT)
        if broken:
            writer.write(row)
        else:
            with pytest.raises(ReportError, match=said):
                writer.write(row)
    assert (target.read_text() == VICTIM_TEXT) != broken
    assert (not (elsewhere / RESULTS_FILE).exists()) != broken


# ---------------------------------------------------------------------------------------------
# docs/reports.md §2 Every write is atomic: a baseline write killed half-way leaves the old baseline
# ---------------------------------------------------------------------------------------------


def _killed(*args, **kwargs) -> None:
    raise KeyboardInterrupt("killed while writing")


def _in_place_half(path: Path, data: str) -> Path:
    """The write as it was (pandas' to_csv straight into the file), killed half-way."""
    Path(path).write_text(data[: len(data) // 2])
    raise KeyboardInterrupt("killed while writing")


@pytest.mark.parametrize("broken", [False, True], ids=["atomic", "in-place"])
def test_a_baseline_write_killed_half_way_leaves_the_old_baseline(
    broken: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = load_rows(make_run(tmp_path / "run"))
    path = write_baseline(run, tmp_path / "baselines" / "cpu-fp32.csv")
    before = path.read_bytes()
    changed = run.assign(value=run["value"] * 0.5)
    if broken:
        monkeypatch.setattr("parity.report.baseline.atomic_write", _in_place_half)
    else:
        monkeypatch.setattr(rundir.os, "fsync", _killed)  # the data is written, the rename never happens
    with pytest.raises(KeyboardInterrupt):
        write_baseline(changed, path)
    assert (path.read_bytes() == before) != broken
    assert [p.name for p in path.parent.iterdir()] == ["cpu-fp32.csv"]  # no temporary file left either


# ---------------------------------------------------------------------------------------------
# docs/reports.md §2 --write-baseline writes exactly where it is told, never into a run
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("broken", [False, True], ids=["as-is", "no-target-check"])
def test_write_baseline_never_rewrites_a_runs_own_results(broken: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`parity review R --write-baseline R/results.csv` (or the option typed before R): the run's
    rows stay; without the check they are rewritten in baseline form, run_id, test, time gone."""
    if broken:
        monkeypatch.setattr("parity.report.baseline.check_baseline_target", Path)
    for form, run_first in (("run-dir-first", True), ("latest-run", False)):  # each form on a run of its own
        (tmp_path / form).mkdir()
        monkeypatch.chdir(tmp_path / form)
        run_dir = make_run(Path("reports") / "runs" / "r")
        before = (run_dir / RESULTS_FILE).read_bytes()
        args = ["review", run_dir] if run_first else ["review"]
        outcome = cli(*args, "--write-baseline", run_dir / RESULTS_FILE, "--no-baseline")
        assert (outcome.code == 2) != broken, outcome.output
        assert ((run_dir / RESULTS_FILE).read_bytes() == before) != broken


# ---------------------------------------------------------------------------------------------
# docs/reports.md §2 review/ is parity's: figures replaced, a user's files never taken
# ---------------------------------------------------------------------------------------------


class _OldAssets(html_mod.Assets):
    """Assets as they were: review/ deleted and made again on every build."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.root = run_dir, run_dir / html_mod.ASSET_DIR
        if self.root.exists():
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True)
        self.staging, self._names = self.root, set()

    def commit(self) -> Path:
        return self.root


@pytest.mark.parametrize("broken", [False, True], ids=["as-is", "old-assets"])
def test_a_review_never_takes_a_users_file_from_review_dir(broken: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_dir = make_run(tmp_path / "run")
    if broken:
        monkeypatch.setattr(page_mod, "Assets", _OldAssets)
    assert cli("review", run_dir, "--no-baseline").code == 0
    assert cli("review", run_dir, "--no-baseline").code == 0  # parity's own review/ is replaced
    notes = run_dir / "review" / "my-notes.md"
    notes.write_text("what I found\n")
    outcome = cli("review", run_dir, "--no-baseline")
    assert (notes.is_file() and outcome.code == 2) != broken, outcome.output


def test_review_dir_without_its_list_is_refused_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review/ that does not list its files (no `.parity-review`) is not known to be parity's,
    whatever its files are called: refused with one line, nothing removed."""
    monkeypatch.chdir(tmp_path)
    run_dir = make_run(tmp_path / "run")
    (run_dir / "review").mkdir()
    (run_dir / "review" / "numerics-ar.png").write_bytes(b"a figure of unknown origin")
    outcome = cli("review", run_dir, "--no-baseline")
    assert outcome.code == 2 and "numerics-ar.png, which parity review did not write" in outcome.output, outcome.output
    assert [p.name for p in (run_dir / "review").iterdir()] == ["numerics-ar.png"]
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".review")]  # no build directory left behind
    (run_dir / "review" / "numerics-ar.png").unlink()
    assert cli("review", run_dir, "--no-baseline").code == 0  # an empty review/ is taken
    listed = (run_dir / "review" / html_mod.REVIEW_MARKER).read_text().split()
    assert sorted(p.name for p in (run_dir / "review").iterdir()) == sorted([html_mod.REVIEW_MARKER, *listed])


# ---------------------------------------------------------------------------------------------
# docs/reports.md §2 A run directory has an owner: a live run is never overwritten, appended to or shared
# ---------------------------------------------------------------------------------------------


def test_a_claim_is_exclusive_and_two_claims_at_once_give_one_owner(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    results: list[str] = []
    claims: list[RunClaim] = []
    start = threading.Barrier(4)

    def claim() -> None:
        start.wait()
        try:
            claims.append(RunClaim.take(run_dir))
            results.append("got")
        except RunInUse:
            results.append("refused")

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == ["got", "refused", "refused", "refused"]
    (owner,) = claims
    owner.record()
    with pytest.raises(RunInUse, match=f"in use by a live run \\(process {os.getpid()} on "):
        RunClaim.take(run_dir)
    owner.release(keep_record=False)
    assert list(run_dir.iterdir()) == []
    fresh = RunClaim.take(tmp_path / "new")
    fresh.release(keep_record=False)
    assert not (tmp_path / "new").exists()  # a claim that wrote no row leaves nothing


def test_without_the_lock_two_sessions_would_own_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant of the test above: flock switched off, a second claim of a held run succeeds."""
    monkeypatch.setattr(rundir.fcntl, "flock", lambda fd, op: None)
    first = RunClaim.take(tmp_path / "r")
    second = RunClaim.take(tmp_path / "r")
    assert first.held and second.held
    first.release(keep_record=True)
    second.release(keep_record=True)


def _claim_and_die(run_dir: Path) -> int:
    """A `parity run` killed outright: it claimed `run_dir`, wrote run.json `running`, then kill -9."""
    code = (
        "import os, sys, json; from pathlib import Path; from parity.report.rundir import RunClaim; "
        "d = Path(sys.argv[1]); c = RunClaim.take(d); c.record(); "
        "(d / 'run.json').write_text(json.dumps({'status': 'running', 'pid': os.getpid(), 'host': os.uname().nodename})); "
        "print(os.getpid(), flush=True); os.kill(os.getpid(), 9)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(run_dir)], env=subprocess_env(), cwd=PROJECT_ROOT, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    return int(done.stdout)


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_a_dead_owner_is_recognised_and_its_run_may_be_taken_over(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    pid = _claim_and_die(run_dir)
    (run_dir / RESULTS_FILE).write_text("rows\n")
    for overwrite, append in ((True, False), (False, True)):
        claim_run_dir(run_dir, overwrite=overwrite, append=append)  # no refusal: nobody holds the claim
    with pytest.raises(RunDirError, match="already holds a run"):
        claim_run_dir(run_dir, overwrite=False, append=False)
    (problem,) = [p for p in completeness(RunFiles.read(run_dir)) if "process" in p]
    assert f"process {pid} on" in problem and "is gone" in problem


def test_the_claim_outranks_a_reused_process_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run.json names a process that is alive (its id reused: here this process), but the claim
    file is there and nobody holds it: the run's owner is gone. Without the claim the review would
    call the run live forever."""
    run_dir = make_run(tmp_path / "r")
    RunClaim.take(run_dir).release(keep_record=True)
    (run_dir / OWNER_FILE).write_text(f'{{"pid": {os.getpid()}, "host": "{os.uname().nodename}", "claimed": "t"}}\n')
    write_run_info(run_dir, {"status": "running", "pid": os.getpid(), "host": os.uname().nodename})
    assert any("is gone" in p for p in completeness(RunFiles.read(run_dir)))
    monkeypatch.setattr("parity.report.run_files.owner_alive", lambda run_dir: None)  # the broken variant
    assert any("still running" in p for p in completeness(RunFiles.read(run_dir)))


def test_a_run_without_a_claim_is_live_while_its_process_is(tmp_path: Path) -> None:
    """A run of a session without a run id (or of an older parity) has no claim file: run.json's
    live process says it is running."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run_dir = make_run(tmp_path / "r", status="running", pid=sleeper.pid)
        with pytest.raises(RunDirError, match=f"in use by a live run \\(process {sleeper.pid} on"):
            claim_run_dir(run_dir, overwrite=True, append=False)
    finally:
        sleeper.kill()
        sleeper.wait()
    claim_run_dir(run_dir, overwrite=True, append=False)


SUITE_TEST = """
import pytest

pytestmark = pytest.mark.parity_suite("selfcheck")


def test_one_row(parity_report):
    report = parity_report
    report.record(case="c", metric="m", value=0, threshold=1, better="lower")
"""


def _session(pytester: pytest.Pytester, out: Path, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_rows=SUITE_TEST)
    return run_pytest_in_pytester(pytester, ["--parity-report-dir", str(out), "--parity-run-id", "r", *args])


def test_a_live_runs_rows_survive_an_overwrite_and_an_append(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session into the run id of a live run (its claim held by this process, as a `parity run` in
    another terminal holds it) is refused, `--parity-overwrite` and `--parity-append` included, and
    the run keeps its rows; with the liveness check and the lock switched off the overwrite deletes them."""
    out = pytester.path / "out"
    run_dir = make_run(out / "r", status="running")
    before = (run_dir / RESULTS_FILE).read_bytes()
    claim = RunClaim.take(run_dir)
    claim.record()
    try:
        for extra in ([], ["--parity-overwrite"], ["--parity-append"]):
            result = _session(pytester, out, *extra)
            assert result.ret == 4 and "is in use by a live run" in result.stderr.str(), result.stderr.str()
            assert (run_dir / RESULTS_FILE).read_bytes() == before
        monkeypatch.setattr("parity.plugin.session.live_owner", lambda run_dir: None)
        monkeypatch.setattr(rundir.fcntl, "flock", lambda fd, op: None)
        result = _session(pytester, out, "--parity-overwrite")
        assert result.ret == 0, result.stdout.str()
        assert (run_dir / RESULTS_FILE).read_bytes() != before  # the live run's rows are gone
    finally:
        claim.release(keep_record=True)


def test_a_session_claims_its_run_id_before_the_first_row_and_leaves_nothing_without_rows(
    pytester: pytest.Pytester,
) -> None:
    out = pytester.path / "out"
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    conftest = (
        "import os\n"
        "def pytest_sessionstart(session):\n"
        f"    owner = os.path.join({str(out)!r}, 'r', {OWNER_FILE!r})\n"
        "    assert os.path.isfile(owner), 'no claim at the start of the session'\n"
    )
    pytester.makeconftest(conftest)
    result = run_pytest_in_pytester(pytester, ["--parity-report-dir", str(out), "--parity-run-id", "r", "test_plain.py"])
    assert result.ret == 0, result.stdout.str()
    assert not (out / "r").exists()  # the claim was given up at unconfigure: no row, nothing left


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_a_dead_owners_run_may_be_appended_to_by_a_session(pytester: pytest.Pytester) -> None:
    out = pytester.path / "out"
    run_dir = make_run(out / "r")
    _claim_and_die_keeping(run_dir)
    result = _session(pytester, out, "--parity-append")
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    assert "test_rows.py" in (run_dir / RESULTS_FILE).read_text()  # the session's row is there, after the earlier ones
    assert rundir.read_owner(run_dir).pid == os.getpid()


def _claim_and_die_keeping(run_dir: Path) -> None:
    """`_claim_and_die` on a complete run: only the claim is left behind (run.json says complete)."""
    info = (run_dir / RUN_INFO_FILE).read_text()
    _claim_and_die(run_dir)
    (run_dir / RUN_INFO_FILE).write_text(info)
    assert rundir.owner_alive(run_dir) is False


def test_a_baseline_error_is_one_line(tmp_path: Path) -> None:
    """Strict baseline reading names the file and line (used by the table's baseline rows)."""
    path = write_baseline(load_rows(make_run(tmp_path / "run")), tmp_path / "b.csv")
    path.write_text(re.sub(r",fixed,(\w*)\n", r",bogus,\1\n", path.read_text(), count=1))  # bound, then family
    with pytest.raises(BaselineError) as caught:
        load_rows(path, strict=True)
    assert "\n" not in str(caught.value) and "b.csv line" in str(caught.value)

"""A run is read once (docs/reports.md §5): `parity review` and what `parity run` says after pytest
open the run's results.csv one time each, whatever the audit, the comparison, the summary, the
scores and the page then do with it. Counted at the file level, so a second reader anywhere (a
`read_results` on the side, a view that reparses the file) is seen; the switched-off variant reads
the run twice and goes red."""

from __future__ import annotations

import argparse
import builtins
import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from parity import cli
from parity.report import ReportWriter, run_files
from parity.report.run_info import write_run_info
from parity.report.schema import RESULTS_FILE
from tests.report.test_review_page import AR_ROWS
from tests.support.stage_rows import chain_rows, failing_gate


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A finished run with passing rows, a failing case and its stage chain (every section of the page has data)."""
    run = tmp_path / "run"
    run.mkdir()
    context = dict(run_id=run.name, target="engine-example", device="cpu", dtype="float32", size="tiny")
    ReportWriter(run, context).write_many(AR_ROWS + [failing_gate("mixed")] + chain_rows("mixed", layers=2))
    write_run_info(run, dict(context, status="complete"))
    return run


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every path opened while the test runs (builtins.open, io.open, and so pathlib and pandas)."""
    seen: list[str] = []
    real = io.open

    def counting(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    monkeypatch.setattr(io, "open", counting)
    yield seen


def results_reads(seen: list[str], run: Path) -> int:
    return sum(Path(p) == run / RESULTS_FILE for p in seen)


def review(run: Path) -> int:
    return cli.main(["review", str(run), "--no-baseline"])


def after_pytest(run: Path) -> int:
    args = argparse.Namespace(append=False)
    return cli._after_pytest(args, run, ["parity", "run"], 1)


@pytest.mark.parametrize("command", [review, after_pytest], ids=["parity-review", "parity-run-after-pytest"])
def test_a_run_is_read_once(command, run_dir: Path, opens: list[str]) -> None:  # type: ignore[no-untyped-def]
    assert command(run_dir) == 1  # the failing case: the whole path ran, page included
    assert (run_dir / "index.html").is_file()
    assert results_reads(opens, run_dir) == 1


@pytest.mark.parametrize("command", [review, after_pytest], ids=["parity-review", "parity-run-after-pytest"])
def test_a_second_read_is_counted(command, run_dir: Path, opens: list[str], monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The switched-off variant: a reader that reads the run again."""
    real = run_files.RunFiles.read.__func__  # type: ignore[attr-defined]

    def twice(cls, path):  # type: ignore[no-untyped-def]
        real(cls, path)
        return real(cls, path)

    monkeypatch.setattr(run_files.RunFiles, "read", classmethod(twice))
    command(run_dir)
    assert results_reads(opens, run_dir) == 2

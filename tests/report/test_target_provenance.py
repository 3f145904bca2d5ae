"""`run.json` says which target ran: its module, version and the git commit of its checkout."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from parity.env import target_provenance
from tests.support.helpers import run_pytest

pytestmark = pytest.mark.parity_cpu


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


@pytest.fixture
def engine_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A porter's engine package in its own git checkout, importable, with a `__version__`."""
    repo = tmp_path / "engine"
    package = repo / "my_engine_pv"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('__version__ = "3.1.4"\n')
    (package / "parity_target.py").write_text(
        textwrap.dedent(
            """
            class Target:
                name = "my-engine"

            def make_target():
                return Target()
            """
        )
    )
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "engine")
    monkeypatch.syspath_prepend(str(repo))
    return repo


def test_provenance_names_module_version_and_commit(engine_repo: Path) -> None:
    __import__("my_engine_pv")
    info = target_provenance("my_engine_pv.parity_target:make_target", "my_engine_pv.parity_target:make_target")
    sha = _git(engine_repo, "rev-parse", "--short=12", "HEAD")
    assert info["module"] == "my_engine_pv.parity_target" and info["version"] == "3.1.4"
    assert info["git_sha"] == sha and info["file"] == str(engine_repo / "my_engine_pv" / "parity_target.py")
    # An unknown module says only what was asked for; nothing is guessed.
    missing = target_provenance("nowhere.mod:f", "nowhere.mod:f")
    assert (missing["module"], missing["file"], missing["version"], missing["git_sha"]) == ("nowhere.mod", "", "", "")


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_run_json_records_the_targets_provenance(engine_repo: Path, tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_demo.py").write_text(
        "import pytest\npytestmark = pytest.mark.parity_suite('demo')\n\n"
        "def test_demo(parity_report, parity_target):\n    parity_report.record(case=parity_target.name, metric='m', value=1.0)\n"
    )
    args = [str(suite), "-q", "--parity-report-dir", str(tmp_path / "out"), "--parity-run-id", "r"]
    args += ["--parity-target", "my_engine_pv.parity_target:make_target"]
    result = run_pytest(args, cwd=suite, PYTHONPATH=f"{engine_repo}:{Path(__file__).resolve().parents[2]}")
    assert result.returncode == 0, result.stdout + result.stderr
    info = json.loads((tmp_path / "out" / "r" / "run.json").read_text())
    provenance = info["target_provenance"]
    assert provenance["module"] == "my_engine_pv.parity_target"
    assert provenance["git_sha"] == _git(engine_repo, "rev-parse", "--short=12", "HEAD")
    assert provenance["version"] == "3.1.4"

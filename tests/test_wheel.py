"""The installed plugin, as a user gets it: build the wheel, install it into a fresh virtual
environment and run `parity run` from an empty directory, with no checkout on the path.

The fresh environment gets parity from the wheel only (`--no-deps`); its dependencies (torch,
pytest, pandas, ...) are made visible through a path file pointing at this environment's
site-packages, so the test needs no network and no second copy of torch. Path files inside that
directory are not processed, so this checkout's own editable install does not leak in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from parity.report import read_results
from tests.helpers import PROJECT_ROOT

pytestmark = pytest.mark.slow


def _run(args: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the parity wheel installed; returns its bin directory."""
    root = tmp_path_factory.mktemp("wheel")
    build = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(root / "dist"),
            str(PROJECT_ROOT),
        ],
        cwd=root,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (root / "dist").glob("parity-*.whl")
    venv = root / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], cwd=root).returncode == 0
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=root).stdout.strip())
    (site / "outer-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], cwd=root)
    assert install.returncode == 0, install.stdout + install.stderr
    return venv / "bin"


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH", "PARITY_CASES_DIR"))}


def test_the_wheel_carries_the_suites_cases_and_entry_points(installed: Path, tmp_path: Path) -> None:
    probe = _run(
        [
            str(installed / "python"),
            "-c",
            "import parity, parity.suites.ar.test_decode as t; from importlib.metadata import entry_points; "
            "from parity.cases import cases_dir; print(parity.__file__); print(sorted(p.name for p in cases_dir().iterdir())); "
            "print([e.value for e in entry_points(group='pytest11') if e.name == 'parity'])",
        ],
        cwd=tmp_path,
        env=_clean_env(),
    )
    assert probe.returncode == 0, probe.stderr
    location, cases, entry = probe.stdout.strip().splitlines()
    assert str(PROJECT_ROOT) not in location, f"parity was imported from the checkout: {location}"
    assert cases == "['ar.toml', 'dit.toml', 'routing.toml', 'selfcheck.toml']"
    assert "parity.plugin" in entry


@pytest.mark.parametrize("suite", ["selfcheck", "weight_coverage"])
def test_parity_run_from_an_empty_directory(installed: Path, tmp_path: Path, suite: str) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _run([str(installed / "parity"), "run", "--suite", suite, "--run-id", "from-wheel"], cwd=empty, env=_clean_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = empty / "reports" / "runs" / "from-wheel"  # the report directory defaults to the working directory's
    rows = read_results(run_dir)
    assert set(rows["suite"]) == {suite} and (rows["verdict"] == "pass").all()
    assert (run_dir / "index.html").is_file() and (run_dir / "run.json").is_file()

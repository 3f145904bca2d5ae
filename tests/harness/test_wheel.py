"""The plugin as users get it: built into a wheel and installed into a fresh virtual environment
(`parity run` from an empty directory, no checkout on the path), and as the GPU box runs it: a
checkout on PYTHONPATH with no install at all (`-p parity.plugin`, no entry point).

Fresh environments get their dependencies (torch, pytest, pandas, ...) through a path file to a
folder of links to this environment's packages, parity's own left out, so the test needs no
network and no second copy of torch, and this checkout's editable install does not leak in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from parity.report import read_results
from tests.support.helpers import PROJECT_ROOT, run_command

pytestmark = pytest.mark.parity_slow
TEMPLATES = PROJECT_ROOT / "parity" / "report" / "templates"


def _run(args: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_command(args, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def dependencies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This environment's installed packages as links, without parity's own distribution."""
    folder = tmp_path_factory.mktemp("dependencies")
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        if entry.name.startswith(("parity", "__editable__", "_parity")) or entry.suffix == ".pth":
            continue
        (folder / entry.name).symlink_to(entry)
    return folder


def _fresh_venv(root: Path, dependencies: Path) -> Path:
    venv = root / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], cwd=root).returncode == 0
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=root).stdout.strip())
    (site / "outer-dependencies.pth").write_text(f"{dependencies}\n")
    return venv


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, dependencies: Path) -> Path:
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
    venv = _fresh_venv(root, dependencies)
    install = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], cwd=root)
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
            "print([e.value for e in entry_points(group='pytest11') if e.name == 'parity']); "
            "from parity.report.html import templates; print(sorted(templates().list_templates()))",
        ],
        cwd=tmp_path,
        env=_clean_env(),
    )
    assert probe.returncode == 0, probe.stderr
    location, cases, entry, templates = probe.stdout.strip().splitlines()
    assert str(PROJECT_ROOT) not in location, f"parity was imported from the checkout: {location}"
    assert cases == str(sorted(p.name for p in (PROJECT_ROOT / "cases").glob("*.toml")))  # every case table, quick.toml too
    assert "quick.toml" in cases and "ar.toml" in cases
    assert "parity.plugin" in entry
    shipped = sorted(str(p.relative_to(PROJECT_ROOT / "parity/report/templates")) for p in TEMPLATES.rglob("*") if p.is_file())
    assert templates == str(shipped), "the review page's templates are not all in the wheel (pyproject.toml package-data)"


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


def test_a_checkout_run_without_installing_loads_the_plugin_in_every_session(dependencies: Path, tmp_path: Path) -> None:
    """The GPU box runs the tree with PYTHONPATH=. and `-p parity.plugin`: no entry point exists, so
    the sensitivity suite's forked sessions must pass `-p parity.plugin` on too (without it every
    child exited 4, "unrecognized arguments: --parity-target", and every mutant looked like a survivor)."""
    venv = _fresh_venv(tmp_path, dependencies)
    # The files a checkout holds (no build metadata such as an editable install's parity.egg-info,
    # which would register the entry point), as the device machine receives them.
    tree = tmp_path / "tree"
    shutil.copytree(
        PROJECT_ROOT,
        tree,
        symlinks=True,
        ignore=shutil.ignore_patterns(".git", ".venv", "*.egg-info", "reports", "build", "dist"),
    )
    env = {**_clean_env(), "PYTHONPATH": str(tree)}
    no_entry_point = _run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "from parity.plugin.options import plugin_is_installed; print(plugin_is_installed())",
        ],
        cwd=tree,
        env=env,
    )
    assert no_entry_point.stdout.strip() == "False", no_entry_point.stdout + no_entry_point.stderr
    out = tmp_path / "out"
    result = _run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pytest",
            "-p",
            "parity.plugin",
            "-p",
            "no:cacheprovider",
            "-q",
            "parity/suites/sensitivity",
            "-k",
            "test_mutant_is_killed and no-clamp-gen-side",
            "--parity-report-dir",
            str(out),
            "--parity-run-id",
            "tree",
        ],
        cwd=tree,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (row,) = read_results(out / "tree").itertuples()
    assert row.verdict == "pass" and row.value == 1, row.detail

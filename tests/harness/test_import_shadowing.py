"""A directory named `parity` on the import path (a clone of this repository beside an engine, its
parent on PYTHONPATH) shadows the installed package; every entry point says so in one line naming
both directories and the fix, instead of `cannot import name 'CaseFileError' from 'parity.cases'`."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from parity import import_check
from tests.support.helpers import OUTER_SESSION_ENV, PROJECT_ROOT, run_command


def test_the_installed_package_is_not_reported() -> None:
    assert import_check.shadowing_problem() is None


def test_a_namespace_parity_is_named_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shadow = types.ModuleType("parity")
    shadow.__path__ = [str(tmp_path / "parity")]
    monkeypatch.setitem(sys.modules, "parity", shadow)
    problem = import_check.shadowing_problem()
    assert problem is not None
    assert f"found {tmp_path / 'parity'}, not the installed parity package at {PROJECT_ROOT / 'parity'}" in problem
    assert "rename that directory" in problem and f"drop {tmp_path} from PYTHONPATH" in problem
    monkeypatch.setattr(import_check, "_is_the_command", lambda: False)
    monkeypatch.delitem(sys.modules, "_pytest.config")
    with pytest.raises(ImportError, match="rename that directory"):
        import_check.refuse_shadowed()


@pytest.fixture
def shadowed(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """`<tmp>/parity`: this repository under its own name, `<tmp>` alone on PYTHONPATH (the
    package is found through the install); skipped where that does not shadow it (an install that
    is not editable: a regular package wins over a namespace directory)."""
    (tmp_path / "parity").symlink_to(PROJECT_ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in OUTER_SESSION_ENV}
    env["PYTHONPATH"] = str(tmp_path)
    probe = subprocess.run(
        [sys.executable, "-c", "import parity; print(list(parity.__path__))"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    if str(PROJECT_ROOT / "parity") in probe.stdout:
        pytest.skip(f"parity is not shadowed by a directory in this install: {probe.stdout.strip()}")
    (tmp_path / "empty").mkdir()
    return tmp_path, env


@pytest.mark.parametrize(
    "args, code, prefix",
    [
        (["-m", "parity", "--help"], 2, ""),
        (["-m", "pytest", "-p", "no:cacheprovider", "--co", "-q", "empty"], 4, "ERROR: "),
        (["-m", "pytest", "-p", "no:cacheprovider", "-p", "parity.plugin", "--co", "-q", "empty"], 4, "ERROR: "),
        (["-c", "import parity.cli"], 1, "parity.import_check.ShadowedParity: "),
    ],
)
def test_every_entry_point_names_the_shadowing_directory(
    shadowed: tuple[Path, dict[str, str]], args: list[str], code: int, prefix: str
) -> None:
    tmp_path, env = shadowed
    result = run_command([sys.executable, *args], cwd=tmp_path, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == code, output
    expected = (
        f"{prefix}parity: `import parity` found {tmp_path / 'parity'}, not the installed parity package at "
        f"{PROJECT_ROOT / 'parity'}: a directory named parity (a checkout?) shadows it; rename that directory, "
        f"or drop {tmp_path} from PYTHONPATH"
    )
    assert any(line.startswith(expected) for line in output.splitlines()), output
    assert "CaseFileError" not in output

"""The tree stays clean under the project's ruff configuration (pyproject.toml): lint and format."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.helpers import PROJECT_ROOT


def _ruff() -> list[str]:
    """ruff from this environment (a test dependency, pinned in pyproject.toml)."""
    beside = Path(sys.executable).parent / "ruff"
    found = str(beside) if beside.exists() else shutil.which("ruff")
    assert found, "ruff is not installed: pip install -e '.[test]' installs the pinned version"
    return [found]


def test_ruff_lint_is_clean() -> None:
    result = subprocess.run(
        [*_ruff(), "check", "--output-format", "concise", "."], cwd=PROJECT_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean() -> None:
    result = subprocess.run([*_ruff(), "format", "--check", "."], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout + result.stderr

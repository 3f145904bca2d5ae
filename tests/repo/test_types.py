"""The tree type-checks under the project's pinned mypy (pyproject.toml, `[tool.mypy]`): the harness
core (parity/ outside its suites) and the example targets, whose adapters are held to the typed
contract of parity/target.py (`_CONTRACT: type[ARAdapter] = ...`). A planted ill-typed example
shows the check going red."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.helpers import PROJECT_ROOT

EXAMPLE = PROJECT_ROOT / "examples" / "engine_target" / "parity_target.py"


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    """mypy from this environment (a test dependency, pinned in pyproject.toml), with the project's
    configuration; its cache outside the tree."""
    beside = Path(sys.executable).parent / "mypy"
    found = str(beside) if beside.exists() else shutil.which("mypy")
    assert found, "mypy is not installed: pip install -e '.[test]' installs the pinned version"
    venv = PROJECT_ROOT / ".venv"
    cache = ["--cache-dir", str(venv / "mypy-cache")] if venv.is_dir() else []  # else .mypy_cache/ (ignored by git)
    return subprocess.run([found, *cache, *args], cwd=PROJECT_ROOT, capture_output=True, text=True)


def test_the_core_and_the_examples_type_check() -> None:
    result = _mypy()
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_example_adapter_that_breaks_the_contract_fails(tmp_path: Path) -> None:
    """The switched-off variant: the example engine's adapter with `embed` taking a list of ids
    instead of a tensor no longer satisfies `ARAdapter`, and mypy names the assignment that says
    it should (and nothing else: the planted copy is otherwise the example)."""
    text = EXAMPLE.read_text()
    good = "    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:\n        return self.module.embed(input_ids)\n"
    assert good in text, "the planted defect no longer matches the example: update this test"
    planted = tmp_path / "examples" / "engine_target" / "planted_target.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(
        text.replace(good, "    def embed(self, input_ids: list[int]) -> torch.Tensor:\n        return torch.tensor(input_ids)\n")
    )
    result = _mypy(str(planted))
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        'Incompatible types in assignment (expression has type "type[EngineARAdapter]", variable has type "type[ARAdapter]")'
        in (result.stdout)
    ), result.stdout
    assert "Found 1 error in 1 file" in result.stdout, result.stdout

"""A repro directory is data: replaying one runs no code that came with it, and a broken one is one line.

`python -m parity.localise.replay DIR` reads `calls.json` and two safetensors files
(docs/localise.md §5). A pickle planted in the directory is refused unread; a `calls.json` naming the standard
library is refused; a damaged or partial directory, or a model package that is not importable
where the repro runs, is one line saying what to do, exit status 2.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from parity.localise.observe import resolve
from parity.localise.repro import StageSource, write_repro
from parity.localise.stages import Tap
from tests.harness.test_localise import TOY, _broken_at, _chain
from tests.support.helpers import PROJECT_ROOT, run_command

pytestmark = pytest.mark.parity_cpu

FULL = {name: Tap(name) for name in "abc"}


def _repro(run_dir: Path, target: nn.Module | None = None, reference: nn.Module | None = None) -> Path:
    broken, correct = _broken_at("b")
    target, reference = target or broken, reference or correct
    chain = _chain(target, reference, FULL)
    x = torch.randn(2, 3, 8)
    path = write_repro(
        run_dir,
        chain,
        case="toy",
        mode="eager",
        target=StageSource(target, resolve(target, FULL, TOY, 0), lambda: target(x)),
        reference=StageSource(reference, resolve(reference, FULL, TOY, 0), lambda: reference(x)),
    )
    assert path.endswith("/repro.py"), path
    return run_dir / Path(path).parent


def _replay(directory: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_command([sys.executable, "-m", "parity.localise.replay", str(directory)], cwd=directory.parent, env=env)


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parity repro: "), result.stderr
    return lines[0]


class _Plant:
    """A pickle that, when loaded, writes a file (what a shell command could do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def test_a_repro_holds_json_and_safetensors_and_runs(tmp_path: Path) -> None:
    directory = _repro(tmp_path)
    assert sorted(p.name for p in directory.iterdir()) == ["calls.json", "inputs.safetensors", "repro.py", "weights.safetensors"]
    calls = json.loads((directory / "calls.json").read_text())
    assert calls["target"]["fn"]["$module"]["class"] == "torch.nn.modules.linear:Linear"
    result = _replay(directory)
    assert result.returncode == 0 and "stage b" in result.stdout and "DIVERGED" in result.stdout, result.stderr


def test_a_planted_pickle_is_refused_in_one_line_and_nothing_in_it_runs(tmp_path: Path) -> None:
    directory = _repro(tmp_path)
    marker = tmp_path / "ran.txt"
    (directory / "calls.pt").write_bytes(pickle.dumps(_Plant(marker)))
    line = _one_line(_replay(directory))
    assert "calls.pt is a pickle, which parity never loads" in line and "write it again" in line
    assert not marker.exists()
    # the plant is live: unpickling it (what parity's replay did before, through torch.load) runs it
    pickle.loads((directory / "calls.pt").read_bytes())
    assert marker.read_text() == "ran"


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("os:system", "never imports the standard library"),
        ("subprocess:run", "never imports the standard library"),
        ("torch.hub:load", "calls functions of the target's packages only"),
    ],
)
def test_a_calls_json_naming_a_dangerous_function_is_refused(tmp_path: Path, spec: str, why: str) -> None:
    directory = _repro(tmp_path)
    calls = json.loads((directory / "calls.json").read_text())
    calls["target"]["fn"] = {"$function": spec}
    calls["target"]["calls"] = [{"args": {"$tuple": [f"touch {tmp_path / 'ran.txt'}"]}, "kwargs": {"$dict": []}}]
    (directory / "calls.json").write_text(json.dumps(calls))
    line = _one_line(_replay(directory))
    assert why in line and "refused" in line, line
    assert not (tmp_path / "ran.txt").exists()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: (d / "calls.json").unlink(), "lacks calls.json: not a whole repro"),
        (lambda d: (d / "weights.safetensors").unlink(), "lacks weights.safetensors: not a whole repro"),
        (lambda d: (d / "calls.json").write_text('{"format": 3, "site": '), "calls.json is not readable JSON"),
        (lambda d: _truncate(d / "inputs.safetensors"), "inputs.safetensors is not a readable safetensors file"),
        (lambda d: (d / "calls.json").write_text(json.dumps({"format": 2})), "repro format 2, this parity reads 3"),
        (lambda d: (d / "calls.json").write_text(json.dumps({"format": 3, "site": "b"})), "calls.json lacks case, mode, target"),
    ],
)
def test_a_damaged_or_partial_repro_is_one_line_with_what_to_do(tmp_path: Path, damage, expected: str) -> None:
    directory = _repro(tmp_path)
    damage(directory)
    line = _one_line(_replay(directory))
    assert expected in line and ("write it again" in line or "copy the whole directory" in line), line


def test_a_model_package_not_importable_where_the_repro_runs_is_one_line(tmp_path: Path) -> None:
    """The engine's classes are named by import path: where its package is not on the path, the
    replay says which module and what to do, instead of a traceback."""
    package = tmp_path / "pkg" / "toy_engine_for_repro"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "layers.py").write_text(
        textwrap.dedent(
            """
            from torch import nn


            class Proj(nn.Linear):
                pass
            """
        )
    )
    sys.path.insert(0, str(package.parent))
    try:
        from toy_engine_for_repro.layers import Proj

        torch.manual_seed(0)
        target = nn.Module()
        target.a, target.b, target.c = Proj(8, 8), Proj(8, 8), Proj(8, 8)
        target.forward = lambda x: target.c(target.b(target.a(x)))
        with torch.no_grad():
            target.b.bias += 0.1
        reference = nn.Module()
        reference.a, reference.b, reference.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        reference.load_state_dict(target.state_dict())
        with torch.no_grad():
            reference.b.bias -= 0.1
        reference.forward = lambda x: reference.c(reference.b(reference.a(x)))
        directory = _repro(tmp_path / "run", target, reference)
    finally:
        sys.path.remove(str(package.parent))
        sys.modules.pop("toy_engine_for_repro.layers", None)
        sys.modules.pop("toy_engine_for_repro", None)
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    line = _one_line(_replay(directory, env))
    assert "toy_engine_for_repro.layers cannot be imported here" in line and "PYTHONPATH" in line, line
    env["PYTHONPATH"] += os.pathsep + str(package.parent)
    result = _replay(directory, env)  # where the package is importable, the same repro runs
    assert result.returncode == 0 and "DIVERGED" in result.stdout, result.stderr

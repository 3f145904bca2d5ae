"""An error row says where in the target's own code it went wrong: the innermost frame outside torch and parity.

A host read in a target's forward (`bool(mask.any())`) is refused by the CPU graph stand-in and by
Dynamo; both errors are raised far from the line a porter edits (in parity's capture guard, in
Dynamo's symbolic execution). `parity.observe.origin` finds that line: in the traceback, in the
cause of a re-raised error, or in Dynamo's record of the frame it was tracing.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

from parity.observe import origin
from parity.observe.compile_ledger import reset_compile_state
from parity.report import read_results
from parity.runners import make_runner
from tests.support import stage_defects
from tests.support.helpers import PROJECT_ROOT, run_pytest

pytestmark = pytest.mark.parity_cpu


class HostRead(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.any()):  # the host read
            return x + 1
        return x


HOST_READ_LINE = inspect.getsourcelines(HostRead.forward)[1] + 1
HERE = Path(__file__).resolve().relative_to(PROJECT_ROOT)


def _raised(mode: str) -> BaseException:
    module = HostRead()
    runner = make_runner(mode, device="cpu", backend="eager")
    with (
        pytest.raises(Exception) as caught,
        runner.prepare(module.forward, (torch.ones(3),), dummy="zeros", name="host-read") as run,
    ):
        run(torch.ones(3))
    return caught.value


@pytest.mark.parametrize("mode", ["cpu_graph", "compiled"])
def test_a_refused_host_read_names_the_targets_line(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(PROJECT_ROOT)
    reset_compile_state()
    try:
        exc = _raised(mode)
    finally:
        reset_compile_state()
    line = origin.error_line(exc)
    assert f"(at {HERE}:{HOST_READ_LINE} in forward)" in line, line
    assert line.startswith(type(exc).__name__) and "\n" not in line
    # the switched-off variant: every frame taken for library code, and no place is found
    monkeypatch.setattr(origin, "is_library", lambda filename: True)
    assert origin.origin_of(exc) == ""


def test_an_error_from_a_re_raise_keeps_the_place_of_its_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(PROJECT_ROOT)

    def targets_code() -> None:
        raise KeyError("layers.2.gen_mlp")

    try:
        try:
            targets_code()
        except KeyError as exc:
            raise RuntimeError("the runner could not record the forward") from exc
    except RuntimeError as exc:
        found = origin.target_frame(exc)
    assert found is not None and found.name == "targets_code"


def test_a_host_read_in_a_third_party_target_is_an_error_row_with_its_line(tmp_path: Path) -> None:
    """The issue's engine: 59 error rows whose detail said where only in the terminal's traceback."""
    source, first = inspect.getsourcelines(stage_defects.HostReadExperts.forward)
    line = first + next(i for i, text in enumerate(source) if "# the host read" in text)
    place = f"tests/support/stage_defects.py:{line} in forward"
    result = run_pytest(
        [
            "parity/suites/ar/test_numerics.py",
            "-k",
            "layer_by_layer and mixed and (cpu_graph or compiled)",
            "-q",
            "--parity-target",
            "tests.support.stage_defects:llama_host_read",
            "--parity-report-dir",
            str(tmp_path),
            "--parity-run-id",
            "r",
        ],
        cwd=PROJECT_ROOT,
    )
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    frame = read_results(tmp_path / "r")
    errors = frame[frame["verdict"] == "error"]
    assert set(errors["mode"]) == {"cpu_graph", "compiled"}, errors[["mode", "detail"]].to_string()
    assert errors["detail"].str.contains(f"(at {place})", regex=False).all(), errors["detail"].tolist()
    summary = result.stdout[result.stdout.index("parity report") :]
    assert f"exception: CaptureError (at {place})" in summary or f"(at {place})" in summary, summary

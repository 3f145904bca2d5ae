"""At full size one model family stays on the device at a time, and only on a card that holds it
(else its tests skip and the summary says why); at tiny size every family is kept."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from parity.plugin.report_fixture import WRITER
from parity.suites import conftest as suites_conftest
from parity.suites.conftest import ResidentModels
from parity.suites.device_memory import GIB, DeviceMemoryError, require_device_memory


def test_each_family_is_built_once_and_kept_when_not_exclusive() -> None:
    built = []
    resident = ResidentModels()
    for family in ("ar", "dit", "ar", "dit"):
        resident.get(family, lambda f=family: built.append(f) or f, exclusive=False)
    assert built == ["ar", "dit"]


def test_exclusive_families_evict_each_other() -> None:
    built = []
    resident = ResidentModels()
    for family in ("ar", "ar", "dit", "dit", "ar"):
        resident.get(family, lambda f=family: built.append(f) or object(), exclusive=True)
    assert built == ["ar", "dit", "ar"] and list(resident.families) == ["ar"]


def test_whole_copies_too_large_for_the_card_are_named_before_any_weight_is_drawn(monkeypatch) -> None:
    """Whole copies of the full-size AR (the DiT's kind of check; the AR family needed this, target,
    reference and a whole fp64 golden, before its golden streamed): an H100 (80 GB) cannot hold
    them, and the error names the need and the card instead of a CUDA out-of-memory error from an
    initialiser."""
    from reference_models.ar.config import ar_config
    from reference_models.ar.model import MammothModa2ForCausalLM

    with torch.device("meta"):
        parameters = sum(p.numel() for p in MammothModa2ForCausalLM(ar_config("full")).parameters())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(78.5 * GIB), int(79.2 * GIB)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    copies = (torch.bfloat16, torch.bfloat16, torch.float64)
    with pytest.raises(DeviceMemoryError) as caught:
        require_device_memory("full-size AR", parameters, copies, torch.device("cuda:0"))
    message = str(caught.value)
    assert "10.70 B parameters as bfloat16 + bfloat16 + float64 = 119.6 GiB of weights needed" in message, message
    assert "78.5 GiB free of 79.2 GiB (NVIDIA H100 80GB HBM3)" in message, message
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(138 * GIB), int(139.8 * GIB)))
    require_device_memory("full-size AR", parameters, copies, torch.device("cuda:0"))  # an H200 holds it
    require_device_memory("full-size AR", parameters, copies, torch.device("cpu"))  # host memory is not checked


class _Writer:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, row: dict) -> None:
        self.rows.append(row)


def _request(nodeid: str, writer: _Writer) -> SimpleNamespace:
    """What `resident_or_skip` reads of a fixture request: the row writer and the test's suite."""
    stash = {WRITER: writer}
    node = SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: SimpleNamespace(args=("numerics",)))
    return SimpleNamespace(config=SimpleNamespace(stash=stash), node=node)


def test_a_family_the_card_cannot_hold_skips_each_test_and_the_summary_says_why(monkeypatch) -> None:
    """The build refuses (need vs have) once; every test of the family skips with that reason
    and leaves a `family_not_provided` row, so the summary under the run's table names the family,
    its tests and the reason. A family the card holds builds and writes no such row."""
    from parity.report import not_provided_lines

    resident, writer, builds = ResidentModels(), _Writer(), []
    monkeypatch.setattr(suites_conftest, "RESIDENT", resident)
    refusal = "full-size AR: ... = 46.0 GiB of weights needed on cuda:0, which has 39.0 GiB free of 39.4 GiB (A100)"

    def build() -> object:
        builds.append("ar")
        raise DeviceMemoryError(refusal)

    for test in ("test_numerics.py::test_layers[und-only-eager]", "test_numerics.py::test_layers[mixed-eager]"):
        with pytest.raises(pytest.skip.Exception, match="46.0 GiB of weights needed"):
            suites_conftest.resident_or_skip(_request(test, writer), "ar", build, exclusive=True)
    assert builds == ["ar"], "a refused family is not built again for each test"
    assert suites_conftest.resident_or_skip(_request("t", writer), "dit", lambda: "dit models", exclusive=True) == "dit models"
    assert len(writer.rows) == 2
    frame = pd.DataFrame(writer.rows)
    assert not_provided_lines(frame) == [f"not run: ar (numerics: 2 tests): {refusal}"]

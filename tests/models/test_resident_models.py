"""At full size one model family stays on the device at a time, and only on a card that holds it;
at tiny size every family is kept."""

from __future__ import annotations

import pytest
import torch

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


def test_a_card_too_small_for_the_full_size_family_is_named_before_any_weight_is_drawn(monkeypatch) -> None:
    """An H100 (80 GB) cannot hold the full-size AR target, reference and fp64 golden: the error
    names the need and the card instead of a CUDA out-of-memory error from an initialiser."""
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
    assert "10.70 B parameters as bfloat16 + bfloat16 + float64 need 119.6 GiB" in message, message
    assert "78.5 GiB free of 79.2 GiB (NVIDIA H100 80GB HBM3)" in message, message
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(138 * GIB), int(139.8 * GIB)))
    require_device_memory("full-size AR", parameters, copies, torch.device("cuda:0"))  # an H200 holds it
    require_device_memory("full-size AR", parameters, copies, torch.device("cpu"))  # host memory is not checked

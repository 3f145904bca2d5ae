"""xdist workers get their own GPU, within an outer CUDA_VISIBLE_DEVICES mask."""

from __future__ import annotations

import pytest

from parity.plugin import lanes as plugin


@pytest.mark.parametrize(
    "worker, mask, chosen", [("gw0", "3,5", "3"), ("gw1", "3,5", "5"), ("gw2", "3,5", "3"), ("gw1", "7", "7")]
)
def test_worker_takes_its_gpu_from_the_outer_mask(monkeypatch, worker: str, mask: str, chosen: str) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    assert plugin.pin_xdist_worker_to_gpu() == chosen
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == chosen


def test_without_a_mask_the_gpus_nvidia_smi_lists_are_used(monkeypatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(plugin, "visible_gpus", lambda: ["0", "1"])
    assert plugin.pin_xdist_worker_to_gpu() == "1"


def test_not_a_worker_or_no_gpu_changes_nothing(monkeypatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert plugin.pin_xdist_worker_to_gpu() is None
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setattr(plugin, "visible_gpus", lambda: [])
    assert plugin.pin_xdist_worker_to_gpu() is None

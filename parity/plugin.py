"""pytest plugin of the parity harness (skeleton: markers and GPU skipping)."""

from __future__ import annotations

import pytest

MARKERS = {
    "cpu": "needs no GPU; selected by the CI lane `pytest -m cpu` (added to every test not marked gpu)",
    "gpu": "needs a CUDA device; skipped with a reason when none is present",
    "slow": "takes more than a few seconds on the CPU lane",
    "benchmark": "a pytest-benchmark measurement; run without xdist (`-p no:xdist`)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") is None and item.get_closest_marker("cpu") is None:
            item.add_marker(pytest.mark.cpu)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("gpu test: no CUDA device on this machine (torch.cuda.is_available() is False)")

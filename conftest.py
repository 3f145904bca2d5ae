"""Repository-only pytest settings. The parity plugin itself is registered by its `pytest11`
entry point (`pip install -e .`); from a checkout without installing, pass `-p parity.plugin`.

In this repository the lanes keep their short names: every test in a parity lane
(`parity_cpu`, `parity_gpu`, `parity_slow`) also carries `cpu`, `gpu` or `slow`, so `pytest -m cpu`
is the CPU lane here (pyproject.toml registers the three)."""

from pathlib import Path

import pytest

from parity.plugin import lanes

SHORT_LANES = {lanes.CPU: "cpu", lanes.GPU: "gpu", lanes.SLOW: "slow"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """After the plugin has given every parity test its lane (its hooks, registered after this
    file, run before it), before pytest's `-m` selects (its own hook runs last). Only in sessions
    of this repository: an editable install's suites sit below this file in any project."""
    if config.rootpath != Path(__file__).resolve().parent:
        return
    for item in items:
        for lane, short in SHORT_LANES.items():
            if item.get_closest_marker(lane) is not None:
                item.add_marker(short)

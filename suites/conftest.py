"""What every parity suite shares: execution modes by device, and skipping modes a target lacks.

A test that takes a `mode` argument is parametrized over the modes of `--device`
(`parity.runners.modes_for`: eager, cpu_graph, compiled on the CPU; eager, cuda_graph, compiled,
compiled_cuda_graph on CUDA). Model fixtures live in the family support modules
(`suites/ar_support.py`, `suites/dit_support.py`, `suites/routing_support.py`) and are
registered here, once: a session fixture imported into each test module would be a separate
fixture per module, built once per module (at full size, 128 GB of AR weights per module).
"""

from __future__ import annotations

import pytest

from parity.runners import modes_for
from suites.ar_support import ar_models  # noqa: F401  (session fixture, defined once here)
from suites.dit_support import dit_models  # noqa: F401  (session fixture, defined once here)


def _parametrizes(metafunc: pytest.Metafunc, name: str) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mode" in metafunc.fixturenames and not _parametrizes(metafunc, "mode"):
        metafunc.parametrize("mode", modes_for(metafunc.config.getoption("--device")))


def require_graph_support(adapter: object, mode: str) -> None:
    """Skip graph modes for a target that cannot be captured (the reference reads masks on the host)."""
    if mode != "eager" and not getattr(adapter, "supports_capture", True):
        pytest.skip(f"{adapter.name} target does not support capture (supports_capture=False): mode {mode} does not apply")

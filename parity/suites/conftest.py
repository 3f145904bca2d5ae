"""What every parity suite shares: execution modes by device, and skipping modes a target lacks.

A test that takes a `mode` argument is parametrized over the modes of `--device`
(`parity.runners.modes_for`: eager, cpu_graph, compiled on the CPU; eager, cuda_graph, compiled,
compiled_cuda_graph on CUDA). Model fixtures live in the family support modules
(`parity/suites/ar/support.py`, `parity/suites/dit/support.py`, `parity/suites/routing/support.py`); the model
fixtures are registered here, once (a fixture imported into each test module would be a separate
fixture per module, built once per module).

At full size one H200 holds one family at a time (the AR pair with its fp64 golden is about
126 GB, the DiT trio about 25 GB), so the models live in `RESIDENT`, which keeps every family at
tiny size and only the family in use at full size; tests are ordered so each family's tests run
together (one build per family and session).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from parity.plugin.session import session_target
from parity.runners import modes_for
from parity.suites.ar.support import ARModels, build_ar_models
from parity.suites.dit.support import DiTModels, build_dit_models, require_dit
from parity.target import TargetError, family_gap

SUITES_DIR = Path(__file__).resolve().parent


def _parametrizes(metafunc: pytest.Metafunc, name: str) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mode" in metafunc.fixturenames and not _parametrizes(metafunc, "mode"):
        metafunc.parametrize("mode", modes_for(metafunc.config.getoption("--parity-device")))


def family_of(item: pytest.Item) -> str | None:
    """The model family of a suite test: its directory under `parity/suites/` (ar, dit, routing, ...)."""
    try:
        return Path(str(item.path)).resolve().relative_to(SUITES_DIR).parts[0]
    except (ValueError, IndexError):
        return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A target that does not provide a model family (no router, no DiT, no AR backbone) gets that
    family's tests skipped with the reason, before any fixture asks it for the missing member."""
    try:
        target = session_target(item.config)
    except TargetError:
        return  # reported once, up front, by the plugin
    reason = family_gap(target, family_of(item) or "")
    if reason:
        pytest.skip(reason)


def require_graph_support(adapter: object, mode: str) -> None:
    """Skip graph modes for a target that cannot be captured (the reference reads masks on the host)."""
    if mode != "eager" and not getattr(adapter, "supports_capture", True):
        pytest.skip(f"{adapter.name} target does not support capture (supports_capture=False): mode {mode} does not apply")


class ResidentModels:
    """Built model families, each built once; at full size only one family stays resident."""

    def __init__(self) -> None:
        self.families: dict[str, Any] = {}

    def get(self, family: str, build: Callable[[], Any], *, exclusive: bool) -> Any:
        if family not in self.families:
            if exclusive:
                self.release()
            self.families[family] = build()
        return self.families[family]

    def release(self) -> None:
        self.families.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


RESIDENT = ResidentModels()
FAMILY_ORDER = ("ar_models", "dit_models")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests of one model family together (AR, then DiT, then the rest), file order kept;
    inside a family, the tests that share compiled code (`keep_compile_cache`) first, so that no
    test starting from an empty Dynamo cache runs between them and throws their compiles away
    (docs/capture-and-compile.md §3)."""

    def family(item: pytest.Item) -> tuple[int, bool]:
        names = getattr(item, "fixturenames", ())
        index = next((i for i, name in enumerate(FAMILY_ORDER) if name in names), len(FAMILY_ORDER))
        return index, item.get_closest_marker("keep_compile_cache") is None

    items.sort(key=family)


@pytest.fixture(scope="session", autouse=True)
def _sensitivity_sessions_early(request: pytest.FixtureRequest, settings: Any, tmp_path_factory: pytest.TempPathFactory):
    """A serial run with a spare core starts the sensitivity suite's isolated sessions at its
    first test, so they run beside the other suites (`parity/suites/sensitivity/runs.py`)."""
    from parity.suites.sensitivity.runs import start_early

    with start_early(request.session, settings, tmp_path_factory):
        yield


@pytest.fixture
def ar_models(settings: Any, target: Any, tmp_path_factory: pytest.TempPathFactory) -> ARModels:
    """The AR target, reference and golden (built once per session while resident)."""
    reason = family_gap(target, "ar")
    if reason:
        pytest.skip(reason)
    build = lambda: build_ar_models(settings, target, tmp_path_factory)
    return RESIDENT.get("ar", build, exclusive=settings.size == "full")


@pytest.fixture
def dit_models(settings: Any, target: Any, tmp_path_factory: pytest.TempPathFactory) -> DiTModels:
    """The DiT target, reference and golden (built once per session while resident)."""
    require_dit(target)
    build = lambda: build_dit_models(target, settings, tmp_path_factory)
    return RESIDENT.get("dit", build, exclusive=settings.size == "full")

"""The short fixture names parity's own test folders use (`report`, `settings`, `run_dir`,
`device`, `target`), each the plugin's namespaced fixture under another name.

Imported by the conftest of `parity/suites` and of this repository's tests, so the names hold
only in those folders: a project's own `report` or `device` fixture elsewhere is never shadowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from parity.plugin.report_fixture import SuiteReport
from parity.plugin.session import RunSession


@pytest.fixture
def report(parity_report: SuiteReport) -> SuiteReport:
    """This test's row writer (`parity_report`)."""
    return parity_report


@pytest.fixture(scope="session")
def settings(parity_settings: RunSession) -> RunSession:
    """The run's options (`parity_settings`)."""
    return parity_settings


@pytest.fixture(scope="session")
def run_dir(parity_run_dir: Path) -> Path:
    """The run directory (`parity_run_dir`)."""
    return parity_run_dir


@pytest.fixture(scope="session")
def device(parity_device: Any) -> Any:
    """The run's torch device (`parity_device`)."""
    return parity_device


@pytest.fixture(scope="session")
def target(parity_target: Any) -> Any:
    """The implementation under test (`parity_target`)."""
    return parity_target

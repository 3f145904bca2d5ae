"""Tests of the harness itself belong to the CPU lane whatever --device says (unless marked gpu)."""

from pathlib import Path

import pytest

# Fixtures shared by several test modules, registered here once (a fixture imported into each
# module would be a separate fixture per module).
from tests.ar_support import reference, serving, tiny_dir  # noqa: F401
from tests.review_run import tiny_run  # noqa: F401  (session fixture: one real tiny run)

pytest_plugins = ["pytester"]  # in-process pytest sessions for the plugin's own tests

_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        in_tests = _HERE in Path(str(item.path)).resolve().parents
        if in_tests and item.get_closest_marker("gpu") is None and item.get_closest_marker("cpu") is None:
            item.add_marker(pytest.mark.cpu)

"""Tests of the harness itself belong to the CPU lane whatever --device says (unless marked gpu)."""

from pathlib import Path

import pytest

from tests.review_run import tiny_run  # noqa: F401  (session fixture: one real tiny run, registered once)

_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents and item.get_closest_marker("gpu") is None:
            if item.get_closest_marker("cpu") is None:
                item.add_marker(pytest.mark.cpu)

"""A switched-off run order, as a pytest plugin (`-p tests.support.order_switches`): expert
selection moved ahead of numerics in `parity.suites.conftest.SUITE_ORDER`, the former order in
miniature (its compiles before the one eager forward that finds most defects). The
test that a numerics defect is printed before expert selection runs must go red under it
(tests/harness/test_live_verdicts.py)."""

from __future__ import annotations

import sys

import pytest


@pytest.hookimpl(tryfirst=True)  # before the suites' conftest orders the tests (it runs trylast)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    suites = sys.modules["parity.suites.conftest"]
    rest = tuple(name for name in suites.SUITE_ORDER if name != "expert_selection")
    suites.SUITE_ORDER = ("expert_selection", *rest)

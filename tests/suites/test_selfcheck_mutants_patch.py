"""The review mutants (parity/suites/selfcheck/mutants.py) patch names that exist: when the report
package moved `allowance_used` and the comparison's factors to `parity.report.comparison`, the
mutants kept writing them onto `parity.report.baseline`, nothing read them, and three mutants
survived as if the self-check suite had missed them. Now a patch of a missing name raises."""

from __future__ import annotations

import importlib
import types

import pytest

from parity.suites.selfcheck import mutants

PATCHED = {
    "allowance_used": "parity.report.comparison",
    "MEASURED_BOUND_FACTOR": "parity.report.comparison",
    "MEASURED_GROUP_FACTOR": "parity.report.comparison",
}


@pytest.mark.parametrize("name, module", sorted(PATCHED.items()))
def test_each_patched_name_is_read_where_it_is_patched(name: str, module: str) -> None:
    assert hasattr(importlib.import_module(module), name)
    assert hasattr(importlib.import_module(module).Comparison, "vanished_gate_rows")


def test_a_patch_of_a_name_that_moved_raises() -> None:
    """The switched-off variant of the guard: the module the patch names lost the function."""
    moved = types.ModuleType("parity.report.comparison_without_it")
    with pytest.raises(AttributeError, match="has no allowance_used: the mutant's patch names nothing"):
        mutants._replace(moved, "allowance_used", lambda *args: 0.0)
    present = types.ModuleType("with_it")
    present.allowance_used = None  # type: ignore[attr-defined]
    mutants._replace(present, "allowance_used", 1)
    assert present.allowance_used == 1  # type: ignore[attr-defined]

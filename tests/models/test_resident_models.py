"""At full size one model family stays on the device at a time; at tiny size every family is kept."""

from __future__ import annotations

from parity.suites.conftest import ResidentModels


def test_each_family_is_built_once_and_kept_when_not_exclusive() -> None:
    built = []
    resident = ResidentModels()
    for family in ("ar", "dit", "ar", "dit"):
        resident.get(family, lambda f=family: built.append(f) or f, exclusive=False)
    assert built == ["ar", "dit"]


def test_exclusive_families_evict_each_other() -> None:
    built = []
    resident = ResidentModels()
    for family in ("ar", "ar", "dit", "dit", "ar"):
        resident.get(family, lambda f=family: built.append(f) or object(), exclusive=True)
    assert built == ["ar", "dit", "ar"] and list(resident.families) == ["ar"]

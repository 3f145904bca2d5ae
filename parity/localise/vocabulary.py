"""The stage vocabulary of each family (`parity.target.FAMILIES` keys), loaded on first use."""

from __future__ import annotations

import importlib

from parity.localise.stages import Vocabulary

FAMILY_VOCABULARIES = ("ar", "dit", "routing")


def vocabulary(family: str) -> Vocabulary:
    """The stages of `family`, in execution order."""
    if family not in FAMILY_VOCABULARIES:
        raise KeyError(f"no stage vocabulary for family {family!r} (families with stages: {', '.join(FAMILY_VOCABULARIES)})")
    return importlib.import_module(f"parity.localise.families.{family}").VOCABULARY

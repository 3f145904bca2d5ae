"""The stage vocabulary of each family (`parity.target.Family.vocabulary`), loaded on first use."""

from __future__ import annotations

import importlib

from parity.localise.stages import Vocabulary
from parity.target import FAMILIES

# family key -> "module:attribute" of its vocabulary
FAMILY_VOCABULARIES = {key: family.vocabulary for key, family in FAMILIES.items() if family.vocabulary}


def vocabulary(family: str) -> Vocabulary:
    """The stages of `family`, in execution order."""
    if family not in FAMILY_VOCABULARIES:
        raise KeyError(f"no stage vocabulary for family {family!r} (families with stages: {', '.join(FAMILY_VOCABULARIES)})")
    module, _, attribute = FAMILY_VOCABULARIES[family].partition(":")
    return getattr(importlib.import_module(module), attribute)

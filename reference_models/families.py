"""The reference side's registry of model families: each family's release layout, by family key.

The keys are those of `parity.target.FAMILIES` (the one definition of a model family: its name,
target members, suites, probe, case file, ...); `tests/repo/test_families.py` checks that every
registry here uses those keys. `reference_models` imports no `parity`, so the family side
registers against the key instead of importing the record.

This module imports the families' layout modules (`reference_models/<family>/release.py`), which
import only their configs and `reference_models.common`: nothing below imports it back. The AR
reference adapter's `load` hands the other families' layouts to the model (`others`), so the
model itself knows no registry. The writers of random checkpoints, which need the models,
register in `reference_models/checkpoints.py`.
"""

from __future__ import annotations

from reference_models.ar import release as ar_release
from reference_models.common.release_layout import ReleaseLayout
from reference_models.dit import release as dit_release

LAYOUTS: dict[str, ReleaseLayout] = {layout.key: layout for layout in (ar_release.LAYOUT, dit_release.LAYOUT)}


def others(key: str) -> tuple[ReleaseLayout, ...]:
    """The layouts of every family but `key`: the tensors a loader of `key` leaves to them."""
    return tuple(layout for name, layout in LAYOUTS.items() if name != key)

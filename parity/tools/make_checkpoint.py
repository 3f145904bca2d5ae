"""`parity make-checkpoint`: a random checkpoint of the reference models, in parity's layout or
the release layout (docs/checkpoints.md), written by the family's writer in
`reference_models/checkpoints.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_checkpoint(kind: str, size: str, seed: int, out_dir: Path, *, layout: str, **options: Any) -> Path:
    """Write the checkpoint of family `kind` (a key of `MAKERS`) and return its directory."""
    from reference_models.checkpoints import make_checkpoint

    return make_checkpoint(kind, size, seed, out_dir, layout=layout, **options)

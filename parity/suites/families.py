"""What the suites of every model family share, read from its record (`parity.target.FAMILIES`):
the guard a family's models and tests stand behind (`require_family`), and the start of its
conformance probe (`probe_loaders`: the family loaded from a tiny checkpoint and built from a
state dict, both checked against its Protocol)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from parity.conformance import Checks
from parity.target import FAMILIES, Target, family_gap
from reference_models.checkpoints import make_checkpoint
from reference_models.common.hf_checkpoint import tensor_names


def require_family(target: Target, family: str) -> None:
    """Skip, with the reason `parity.target.family_gap` gives, for a target that does not provide `family`."""
    reason = family_gap(target, family)
    if reason:
        pytest.skip(reason)


def probe_loaders(
    checks: Checks,
    target: Target,
    family: str,
    protocol: type,
    *,
    config: object,
    state: Mapping[str, torch.Tensor],
    device: str,
    expected: str,
) -> tuple[Any, Any, set[str]] | None:
    """The family's adapter twice, from the target's loader (`Family.loader`, on a tiny checkpoint
    written by the model side's maker for `family`) and from its builder (`Family.builder`, on
    `config` and `state`), and the tensor names of that checkpoint; None, with the problems in
    `checks`, when either call fails or returns something that lacks a member of `protocol`.
    `expected` says what the call should return in a problem line (a docs/targets.md section).
    On success `checks.what` names the adapter's class, as the probe's later lines do."""
    record = FAMILIES[family]
    with tempfile.TemporaryDirectory(prefix="parity-conformance-") as directory:
        make_checkpoint(family, "tiny", 0, directory)
        names = set(tensor_names(directory))
        adapter = checks.obtain(
            f"target.{record.loader}(tiny checkpoint, device, float32)",
            lambda: getattr(target, record.loader)(directory, device, torch.float32),
            expected,
        )
    built = checks.obtain(
        f"target.{record.builder}(config, state_dict, device, float32)",
        lambda: getattr(target, record.builder)(config, state, device, torch.float32),
        expected,
    )
    if adapter is None or built is None or not checks.require(adapter, protocol, f"{record.name} adapter"):
        return None
    if not checks.require(built, protocol, f"{record.name} adapter of {record.builder}"):
        return None
    checks.what = f"{record.name} adapter {type(adapter).__name__}"
    checks.expect(isinstance(adapter.name, str) and adapter.name != "", f"name must be a non-empty str, got {adapter.name!r}")
    return adapter, built, names

"""Tell a target "you are being captured" through the capture-probe registry the target owns.

The harness never imports a model package, so the registry is handed in as an object. Two shapes
are accepted (duck typing, as `serving_models/common/capture.py` provides both):
`capture_probe(backend, fn)` (a context manager), or `register_capture_probe(backend, fn)`
returning the previous probe. Without a registry the target gets no signal, which is what a
backend without a probe does to a real engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _always_capturing() -> bool:
    return True


@contextlib.contextmanager
def reporting_capture(registry: Any | None, backend: str) -> Iterator[None]:
    """While active, `registry`'s probe for `backend` answers True; the previous probe returns after."""
    if registry is None:
        yield
        return
    if hasattr(registry, "capture_probe"):
        with registry.capture_probe(backend, _always_capturing):
            yield
        return
    if hasattr(registry, "register_capture_probe"):
        previous = registry.register_capture_probe(backend, _always_capturing)
        try:
            yield
        finally:
            registry.register_capture_probe(backend, previous)
        return
    raise TypeError(
        f"capture registry {registry!r} has neither capture_probe(backend, fn) nor "
        "register_capture_probe(backend, fn): cannot tell the target it is being captured"
    )


def target_sees_capturing(registry: Any | None, device: torch.device) -> bool | None:
    """What the target's own `is_capturing(device)` answers now (None if the registry cannot say)."""
    if registry is None or not hasattr(registry, "is_capturing"):
        return None
    return bool(registry.is_capturing(device))

"""The reference's answer to "am I being captured?": never.

The reference is eager by definition (host-side branches are its point), so it has no capture
concept. This module has the same API shape as the serving target's capture-probe registry so a
harness can treat both targets alike: probes may be registered and are ignored, and
`is_capturing` is always False.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

CaptureProbe = Callable[[], bool]


def register_capture_probe(backend: str, probe: CaptureProbe | None) -> CaptureProbe | None:
    """Accepted and ignored: the reference never runs under capture. Returns None."""
    return None


@contextlib.contextmanager
def capture_probe(backend: str, probe: CaptureProbe | None) -> Iterator[None]:
    yield


def registered_backends() -> tuple[str, ...]:
    return ()


def is_capturing(device: torch.device | str) -> bool:
    return False

"""Capture probes: the one question a serving model asks about its execution context.

A graph-safe model must know whether the current stream is being captured into a graph (a
CUDA graph, or the harness's CPU stand-in), because a host read of a tensor value is illegal
there and any Python branch taken during capture is baked into every replay. The model owns
this small registry; backends (CUDA built in, NPU/XPU, the parity harness's `cpu_graph`
runner) register a probe per device type. A backend without a probe warns once per process
and is reported as "not capturing", the behaviour vllm-project/vllm-omni#9764 specifies.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

CaptureProbe = Callable[[], bool]


class MissingCaptureProbeWarning(RuntimeWarning):
    """Raised (as a warning) the first time a backend without a capture probe is asked."""


def _cpu_never_captures() -> bool:
    # Plain PyTorch has no CPU stream capture; the harness's stand-in registers its own probe.
    return False


_probes: dict[str, CaptureProbe] = {
    "cuda": torch.cuda.is_current_stream_capturing,
    "cpu": _cpu_never_captures,
}
_warned: set[str] = set()
_lock = threading.Lock()


def _backend_name(device: torch.device | str) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def register_capture_probe(backend: str, probe: CaptureProbe | None) -> CaptureProbe | None:
    """Install `probe` for `backend` (a device type such as "cuda", "npu"); return the previous one.

    Passing None removes the backend's probe, so the backend warns once and reports "not
    capturing".
    """
    with _lock:
        previous = _probes.get(backend)
        if probe is None:
            _probes.pop(backend, None)
        else:
            _probes[backend] = probe
        return previous


@contextlib.contextmanager
def capture_probe(backend: str, probe: CaptureProbe | None) -> Iterator[None]:
    """Temporarily install `probe` for `backend`, restoring the previous probe on exit."""
    previous = register_capture_probe(backend, probe)
    try:
        yield
    finally:
        register_capture_probe(backend, previous)


def registered_backends() -> tuple[str, ...]:
    with _lock:
        return tuple(sorted(_probes))


def is_capturing(device: torch.device | str) -> bool:
    """True while the current stream of `device`'s backend is being captured into a graph."""
    backend = _backend_name(device)
    probe = _probes.get(backend)
    if probe is None:
        with _lock:
            first = backend not in _warned
            _warned.add(backend)
        if first:
            warnings.warn(
                f"backend {backend!r} has no capture probe: graph capture cannot be detected, "
                "so MoE layers take their eager dispatch; register one with "
                "serving_models.common.capture.register_capture_probe",
                MissingCaptureProbeWarning,
                stacklevel=2,
            )
        return False
    return bool(probe())

"""Whether one device can hold a family's full-size models, asked before any weight is drawn on it.

At full size a family is the target and the reference in the run's dtype plus the fp64 golden. The
AR golden streams (docs/lanes.md §4): it adds one unit's fp64 weights, not the model's, so the AR
family needs about 42 GiB of weights in bf16 where a whole fp64 golden made it 120 GiB. The DiT
golden is whole (its trio is about 25 GB). On a card that cannot hold them, the CUDA out-of-memory
error would come from a random initialiser part-way through the build, naming neither the model
nor what it needs; the suites skip instead, with this module's message (need and have).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

GIB = 2**30


class DeviceMemoryError(RuntimeError):
    """The device cannot hold the models a suite needs; the message says how much is missing."""


def require_device_bytes(what: str, parts: Mapping[str, int], device: torch.device) -> None:
    """Raise `DeviceMemoryError` when the bytes of `parts` (what -> bytes), together, exceed the
    device's free memory. Weights only: activations and graph pools come on top, so passing this
    is necessary, not sufficient. CPU devices are not checked."""
    if device.type != "cuda":
        return
    need = sum(parts.values())
    free, total = torch.cuda.mem_get_info(device)
    if need <= free:
        return
    items = " + ".join(f"{name} {size / GIB:.1f} GiB" for name, size in parts.items()) if len(parts) > 1 else next(iter(parts))
    raise DeviceMemoryError(
        f"{what}: {items} = {need / GIB:.1f} GiB of weights needed on {device}, which has {free / GIB:.1f} GiB free "
        f"of {total / GIB:.1f} GiB ({torch.cuda.get_device_name(device)}); run the full-size lane on a larger card "
        "or the tiny configuration (--parity-size tiny)"
    )


def require_device_memory(what: str, parameters: int, dtypes: Sequence[torch.dtype], device: torch.device) -> None:
    """`require_device_bytes` for whole copies of `parameters` parameters, one in each of `dtypes`."""
    copies = " + ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
    need = parameters * sum(dtype.itemsize for dtype in dtypes)
    require_device_bytes(what, {f"{parameters / 1e9:.2f} B parameters as {copies}": need}, device)

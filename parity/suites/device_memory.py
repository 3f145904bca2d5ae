"""Whether one device can hold a family's full-size models, asked before any weight is drawn on it.

At full size a family is the target and the reference in the run's dtype plus the fp64 golden:
12 bytes a parameter in bf16, about 120 GiB for the 10.7 B-parameter AR backbone (docs/lanes.md §1).
On a card that cannot hold them, the CUDA out-of-memory error would come from a random initialiser
part-way through the build, naming neither the model nor what it needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GIB = 2**30


class DeviceMemoryError(RuntimeError):
    """The device cannot hold the models a suite needs; the message says how much is missing."""


def require_device_memory(what: str, parameters: int, dtypes: Sequence[torch.dtype], device: torch.device) -> None:
    """Raise `DeviceMemoryError` when the weights of `parameters` parameters, once in each of
    `dtypes`, exceed the device's free memory. Weights only: activations and graph pools come on
    top, so passing this is necessary, not sufficient. CPU devices are not checked."""
    if device.type != "cuda":
        return
    need = parameters * sum(dtype.itemsize for dtype in dtypes)
    free, total = torch.cuda.mem_get_info(device)
    if need <= free:
        return
    copies = " + ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
    raise DeviceMemoryError(
        f"{what}: {parameters / 1e9:.2f} B parameters as {copies} need {need / GIB:.1f} GiB of weights on "
        f"{device}, which has {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB "
        f"({torch.cuda.get_device_name(device)}); run the full-size lane on a larger card "
        "(one H200 holds it) or the tiny configuration (--parity-size tiny)"
    )

"""What the fail_closed_capture suite runs in fresh processes, parameterized by environment variables.

A failed CUDA capture poisons the process's CUDA RNG, and "warn exactly once per process" can
only be checked in a process that has not warned yet, so these run in children. The child finds
the target spec, size, seed and device in `PARITY_FC_*` variables the suite sets. The refusal is
checked on the tiny configuration in every lane: it happens at the first MoE layer, before any
width matters.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import torch

from parity.contract import words
from parity.runners.capture_isolated import CaptureCase
from parity.target import resolve_target
from reference_models.checkpoints import make_checkpoint

ENV_TARGET, ENV_SEED, ENV_DEVICE = "PARITY_FC_TARGET", "PARITY_FC_SEED", "PARITY_FC_DEVICE"
ENV_LAYOUT = "PARITY_FC_LAYOUT"
PROBE_WORD = words("probe_warning_text")  # what a missing-probe warning must say (docs/targets.md §2.1)


def _checkpoint():
    seed, layout = int(os.environ.get(ENV_SEED, "0")), os.environ.get(ENV_LAYOUT, "parity")
    return make_checkpoint("ar", "tiny", seed, tempfile.mkdtemp(prefix="parity-fc-"), layout=layout)


def _adapter():
    target = resolve_target(os.environ.get(ENV_TARGET, "serving"))
    device = torch.device(os.environ.get(ENV_DEVICE, "cpu"))
    return target, target.load_ar(_checkpoint(), device, torch.float32), device


def capture_without_mask() -> CaptureCase:
    """The child's factory: the case below for the target named in the environment."""
    target, adapter, device = _adapter()
    return capture_without_mask_case(target, adapter, device)


def capture_without_mask_case(target, adapter, device: torch.device) -> CaptureCase:
    """Capture the forward on embeddings alone: no ids, so no mask reaches the MoE layers."""
    embeds = adapter.embed(torch.zeros(1, 6, dtype=torch.long, device=device))

    def forward_on_embeddings(inputs_embeds: torch.Tensor):
        return adapter.forward(None, inputs_embeds)

    return CaptureCase(forward_on_embeddings, (embeds,), name="forward(inputs_embeds only)", capture_registry=target.capture)


def count_missing_probe_warnings(calls: int = 25) -> tuple[int, int]:
    """Remove the CPU backend's probe through the target's registry and count the warnings that
    say a capture probe is missing: first over `calls` forwards of one model instance, then over
    `calls` forwards alternating between that instance and two more built in the same process
    (one before, one after the second phase starts). The contract is once per process, so the
    counts must be 1 and 0: a per-instance (or per-layer) "once" shows in one of them."""
    target, adapter, device = _adapter()
    ids = torch.tensor([[3, 17, 42, 5]], device=device)
    target.capture.register_capture_probe(device.type, None)

    def count(forwards) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for forward in forwards:
                forward(ids)
        return sum(PROBE_WORD in str(w.message).lower() for w in caught)

    first = count([adapter.forward] * calls)
    second = target.load_ar(_checkpoint(), device, torch.float32)
    third = []  # built between forwards, after the process has warned

    def third_forward(input_ids: torch.Tensor):
        if not third:
            third.append(target.load_ar(_checkpoint(), device, torch.float32))
        return third[0].forward(input_ids)

    more = count([adapter.forward, second.forward, third_forward] * (calls // 3 + 1))
    return first, more

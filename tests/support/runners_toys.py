"""Small modules the runner and ledger tests run, each shaped like a defect from the seeds.

Kept tiny: Dynamo and make_fx cost scales with ops, and the CPU tests must stay fast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from parity.runners.capture_isolated import CaptureCase

GEN_START = 8  # token ids >= GEN_START are generation tokens (routed to the gen expert)
WIDTH = 4


def seeded_linear(seed: int) -> nn.Linear:
    generator = torch.Generator().manual_seed(seed)
    layer = nn.Linear(WIDTH, WIDTH)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(WIDTH, WIDTH, generator=generator))
        layer.bias.copy_(torch.randn(WIDTH, generator=generator))
    return layer


class BranchFree(nn.Module):
    """No host control flow at all: every mode must agree with eager."""

    def __init__(self) -> None:
        super().__init__()
        self.up = seeded_linear(1)
        self.down = seeded_linear(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x))) + x


class FlagBranch(nn.Module):
    """A Python branch on attribute state: a graph bakes whichever branch ran at capture."""

    def __init__(self) -> None:
        super().__init__()
        self.negate = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -x * 2 if self.negate else x * 2


class TwoExpertMoE(nn.Module):
    """und / gen expert layer in two dispatch styles.

    "blend": graph-safe, both experts on every row, select with `where` on the device (the
    vllm-project/vllm-omni#9764 fix). "host": the #7318 shape, the expert is chosen on the host from step
    metadata that the engine computes before launching the step (`prepare_step`), so a graph
    captured on the all-zero dummy batch bakes the und expert.
    """

    def __init__(self, dispatch: str) -> None:
        super().__init__()
        self.dispatch = dispatch
        self.und = seeded_linear(3)
        self.gen = seeded_linear(4)
        self.batch_has_gen = False

    def prepare_step(self, ids: torch.Tensor, x: torch.Tensor) -> None:
        # Host-side step metadata: runs outside capture, on the dummy batch at capture time.
        self.batch_has_gen = bool((ids >= GEN_START).any())

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.dispatch == "host":
            return self.gen(x) if self.batch_has_gen else self.und(x)
        is_gen = (ids >= GEN_START)[:, None]
        return torch.where(is_gen, self.gen(x), self.und(x))


class HostRead(nn.Module):
    """Reads a tensor's value on the host in one of several ways (each must fail capture)."""

    PATTERNS = ("item", "tensor_if", "tolist", "numpy", "nonzero", "bool_mask", "equal")

    def __init__(self, pattern: str) -> None:
        super().__init__()
        if pattern not in self.PATTERNS:
            raise ValueError(pattern)
        self.pattern = pattern

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pattern
        if p == "item":
            return x * x.sum().item()
        if p == "tensor_if":
            return x + 1 if (x > 0).any() else x - 1
        if p == "tolist":
            return x + len([v for v in x.tolist() if v > 0])
        if p == "numpy":
            return x + float(x.numpy().sum())
        if p == "nonzero":
            return x[x.nonzero()[:, 0]].sum() + x
        if p == "bool_mask":
            return x[x > 0].sum() + x
        return x + 1 if torch.equal(x, torch.zeros_like(x)) else x - 1


class StaticCache(nn.Module):
    """A static KV-cache-like buffer written in place at `pos`, read back whole."""

    def __init__(self, slots: int = 4) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(slots, WIDTH))

    def forward(self, pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0, keepdim=True) * 1.0


class RepeatedCall(nn.Module):
    """Calls the same submodule three times per forward (taps must list every call in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, WIDTH)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(5)))
        self.step = seeded_linear(6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input=ids.clamp(0, 15))  # keyword-only call: the tap takes the keyword
        for _ in range(3):
            h = torch.tanh(self.step(h))
        return h


class CapturingProbeRecorder(nn.Module):
    """Records what the target's own `is_capturing(device)` answered on each Python-level call."""

    def __init__(self, registry) -> None:
        super().__init__()
        self.registry = registry
        self.answers: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.answers.append(self.registry.is_capturing(x.device))
        return x * 3


# Factories for parity.runners.capture_isolated (imported by name in a fresh process).


def host_read_case_cpu() -> CaptureCase:
    return CaptureCase(fn=HostRead("item").forward, example_inputs=(torch.randn(4),))


def host_sync_case_cuda() -> CaptureCase:
    module = HostRead("item").cuda()
    return CaptureCase(fn=module.forward, example_inputs=(torch.randn(4, device="cuda"),))


def tensor_if_case_cuda() -> CaptureCase:
    module = HostRead("tensor_if").cuda()
    return CaptureCase(fn=module.forward, example_inputs=(torch.randn(4, device="cuda"),), name="decoder.layers.2.mlp")


def branch_free_case_cuda() -> CaptureCase:
    module = BranchFree().cuda()
    return CaptureCase(fn=module.forward, example_inputs=(torch.randn(2, WIDTH, device="cuda"),))


def fake_modes_made(run: Callable[[], Any]) -> int:
    """How many `FakeTensorMode`s `run()` builds (each one extracts the whole calling stack)."""
    import pytest
    from torch._subclasses import fake_tensor

    made = 0
    original = fake_tensor.FakeTensorMode.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal made
        made += 1
        original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fake_tensor.FakeTensorMode, "__init__", counting)
        run()
    return made

"""Where a step's time goes: a torch.profiler breakdown by kernel, written into the run directory.

On CUDA the profiler records every kernel a step launches, graph replays included (CUPTI reports
the kernels of a replayed graph one by one), with its device time; on the CPU it records ATen ops
with their self time. `profile_step` groups them by name and category (GEMM, attention, other) per
step, so the benchmark can say how much of a decode step is the weight-reading GEMMs and how much
is everything else (launch count, small element-wise kernels, attention over the KV cache).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

CATEGORIES = (
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|splitk|aten::(mm|addmm|bmm|linear|matmul)\b", re.IGNORECASE)),
    ("attention", re.compile(r"sdpa|flash|fmha|attention|cudnn", re.IGNORECASE)),
)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """Kernels (CUDA) or ATen ops (CPU) of one step: one row per name, per-step calls and microseconds."""

    table: pd.DataFrame  # name, category, calls_per_step, us_per_step, share
    steps: int

    @property
    def launches_per_step(self) -> float:
        return float(self.table["calls_per_step"].sum())

    @property
    def busy_ms(self) -> float:
        return float(self.table["us_per_step"].sum()) / 1e3

    def category_ms(self, label: str) -> float:
        return float(self.table.loc[self.table["category"] == label, "us_per_step"].sum()) / 1e3

    def write(self, path: Path, title: str, top: int = 25) -> Path:
        """The whole table as CSV beside a readable text file of the top entries and the totals."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.table.to_csv(path.with_suffix(".csv"), index=False)
        lines = [
            title,
            f"per step, mean of {self.steps} profiled steps: {self.launches_per_step:.0f} launches, "
            f"{self.busy_ms:.3f} ms busy (gemm {self.category_ms('gemm'):.3f}, attention "
            f"{self.category_ms('attention'):.3f}, other {self.category_ms('other'):.3f})",
            "",
            self.table.head(top).to_string(index=False, float_format=lambda v: f"{v:.3f}"),
        ]
        path.with_suffix(".txt").write_text("\n".join(lines) + "\n")
        return path.with_suffix(".txt")


def profile_step(fn: Callable[[], object], device: torch.device, steps: int) -> StepProfile:
    """Profile `steps` calls of `fn` (after one warm call) and group what ran by name."""
    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    calls: Counter[str] = Counter()
    micros: Counter[str] = Counter()
    if cuda:
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                calls[event.name] += 1
                micros[event.name] += event.device_time
    else:
        for event in prof.key_averages():
            if event.self_cpu_time_total > 0:
                calls[event.key] += event.count
                micros[event.key] += event.self_cpu_time_total
    table = pd.DataFrame(
        {
            "name": list(micros),
            "category": [category(name) for name in micros],
            "calls_per_step": [calls[name] / steps for name in micros],
            "us_per_step": [micros[name] / steps for name in micros],
        }
    )
    if not table.empty:
        table = table.sort_values("us_per_step", ascending=False, ignore_index=True)
        table["share"] = table["us_per_step"] / table["us_per_step"].sum()
    else:
        table["share"] = []
    return StepProfile(table, steps)

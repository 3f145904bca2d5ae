"""Facts about the environment a run happened in, for every report row and the run's `run.json`."""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def git_sha(root: Path = PROJECT_ROOT) -> str:
    """Short commit of the tree under test, with `-dirty` when it has uncommitted changes."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def torch_version() -> str:
    import torch

    return torch.__version__


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def describe(device: str) -> dict[str, Any]:
    """The environment block written to `run.json` and shown on the review page."""
    import torch

    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "device": device,
        "device_name": device_name(device),
        "git_sha": git_sha(),
        "cpu_threads": torch.get_num_threads(),
    }
    return info

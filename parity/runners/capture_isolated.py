"""Negative capture tests in a fresh process.

A capture that fails on a host synchronisation leaves the process's CUDA RNG unusable ("Offset
increment outside graph capture encountered unexpectedly", measured on an H200 with torch 2.11),
so a test that expects a capture to fail must not run it in the pytest process. This module
spawns a fresh Python that builds the case from an importable factory, prepares it in the given
mode, and reports back whether the capture failed and with which message.

A factory is a zero-argument callable named "package.module:function" that returns a
`CaptureCase`. The child runs with the caller's working directory and `sys.path` entries on its
`PYTHONPATH`, so a factory in a test module (`tests.runners.test_runners_gpu:host_sync_case`) imports.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from parity.observe.progress import run_watched

_MARKER = "PARITY_ISOLATED_CAPTURE "


@dataclass
class CaptureCase:
    """What the child process prepares: `runner.prepare(fn, example_inputs, ...)`."""

    fn: Callable[..., Any]
    example_inputs: Sequence[torch.Tensor]
    name: str | None = None
    dummy: Literal["zeros", "example"] = "zeros"
    taps: Mapping[str, nn.Module] | None = None
    capture_registry: Any | None = None
    runner_knobs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class IsolatedCapture:
    """The child's report. `captured` False means the capture failed with `error_type`/`message`."""

    captured: bool
    error_type: str | None
    cause_type: str | None  # the exception CUDA/torch raised underneath the CaptureError
    message: str | None
    rng_usable_after: bool | None  # could the child still draw CUDA random numbers afterwards
    returncode: int
    stderr_tail: str


def capture_in_subprocess(
    factory: str,
    *,
    mode: str = "cuda_graph",
    device: str = "cuda",
    cwd: str | Path | None = None,
) -> IsolatedCapture:
    """Prepare the case `factory` builds in a fresh Python and report how the capture went."""
    if ":" not in factory:
        raise ValueError(f"factory must be 'package.module:function', got {factory!r}")
    workdir = Path(cwd) if cwd is not None else Path.cwd()
    env = dict(os.environ)
    paths = [str(workdir), *[p for p in sys.path if p]]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    request = json.dumps({"factory": factory, "mode": mode, "device": device})
    code = "import sys; from parity.runners.capture_isolated import _child_main; _child_main(sys.argv[1])"
    completed = run_watched([sys.executable, "-c", code, request], cwd=workdir, env=env)  # stopped only when it stalls
    report = None
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith(_MARKER):
            report = json.loads(line[len(_MARKER) :])
            break
    stderr_tail = completed.stderr[-4000:]
    if report is None:
        raise RuntimeError(
            f"isolated capture of {factory} ({mode} on {device}) exited {completed.returncode} "
            f"without a report; stderr:\n{stderr_tail}"
        )
    return IsolatedCapture(**report, returncode=completed.returncode, stderr_tail=stderr_tail)


def _load_factory(path: str) -> Callable[[], CaptureCase]:
    module_name, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def _child_main(request_json: str) -> None:
    from parity.runners import make_runner
    from parity.runners.base import CaptureError

    request = json.loads(request_json)
    device = torch.device(request["device"])
    report: dict[str, Any] = {
        "captured": False,
        "error_type": None,
        "cause_type": None,
        "message": None,
        "rng_usable_after": None,
    }
    case = _load_factory(request["factory"])()
    runner = make_runner(request["mode"], device=device, capture_registry=case.capture_registry, **case.runner_knobs)
    try:
        prepared = runner.prepare(case.fn, case.example_inputs, dummy=case.dummy, taps=case.taps, name=case.name)
        prepared.close()
        report["captured"] = True
    except CaptureError as error:
        report["error_type"] = type(error).__name__
        report["cause_type"] = type(error.__cause__).__name__ if error.__cause__ is not None else None
        report["message"] = str(error)
    except Exception as error:  # not a capture failure: report it as is
        report["error_type"] = type(error).__name__
        report["message"] = str(error)
    if device.type == "cuda":
        try:
            torch.randn(4, device=device)
            torch.cuda.synchronize(device)
            report["rng_usable_after"] = True
        except Exception:
            report["rng_usable_after"] = False
    print(_MARKER + json.dumps(report), flush=True)

"""Lanes: the markers, which tests the plugin acts on, the CPU lane's threads and xdist's GPUs.

The plugin is installed for every pytest session of an environment, so it acts only on parity's
own tests: those marked `suite(...)`, or every test when the rootdir's configuration says
`parity_scope = "all"` (this repository does, for its harness tests). On those it adds the lane
marker of `--parity-device` to unmarked tests (so `-m cpu` / `-m gpu` select lanes), sets the CPU
lane's thread count and resets Dynamo before each test; in any other session it changes nothing.
"""

from __future__ import annotations

import os
import subprocess

import pytest

MARKERS = {
    "cpu": "needs no GPU; the CI lane `pytest -m cpu` (unmarked parity tests take the lane of --parity-device)",
    "gpu": "needs a CUDA device; skipped with a reason when none is present",
    "slow": "takes more than a few seconds on the CPU lane",
    "benchmark": "a pytest-benchmark measurement; run without xdist (`-p no:xdist`)",
    "suite(name)": "the report suite a test writes rows for (e.g. numerics, routing)",
    "keep_compile_cache": (
        "skip the per-test Dynamo reset: for parity tests that compare outputs of the same compiled "
        "functions (reuse cannot hide a parity failure; guards still hold) and must not recompile them"
    ),
}
# Tiny CPU models run faster on one thread than on two contended ones (a tiny forward: ~1.5 ms vs
# ~200 ms on a shared 2-core box), and a fixed thread count keeps reductions, hence rows, the same
# between serial and xdist runs. PARITY_CPU_THREADS overrides it.
CPU_THREADS_ENV = "PARITY_CPU_THREADS"
SCOPES = ("suites", "all")
# torch's Inductor CPU backend imports torch.utils.mkldnn, which decorates with the deprecated
# torch.jit.script_method: torch's own import, nothing a parity test does.
IGNORED_WARNINGS = ("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",)


def register_markers(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    for warning in IGNORED_WARNINGS:
        config.addinivalue_line("filterwarnings", warning)


def suite_of(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("suite")
    return marker.args[0] if marker and marker.args else None


def scope(config: pytest.Config) -> str:
    value = str(config.getini("parity_scope")).strip() or "suites"
    if value not in SCOPES:
        raise pytest.UsageError(f"ini option parity_scope = {value!r}: expected one of {', '.join(SCOPES)}")
    return value


def parity_session(config: pytest.Config) -> bool:
    """Whether the session is a parity one before anything is collected: `parity_scope = all`, or
    a `--parity-*` option on the command line (`parity run` always passes one)."""
    return scope(config) == "all" or any(str(a).startswith("--parity-") for a in config.invocation_params.args)


def is_parity_test(item: pytest.Item) -> bool:
    """Whether the plugin acts on `item` (see the module docstring)."""
    return suite_of(item) is not None or scope(item.config) == "all"


def mark_lanes(items: list[pytest.Item], device: str) -> None:
    """Give unmarked parity tests the lane of `device`."""
    lane = "gpu" if device == "cuda" else "cpu"
    for item in items:
        if is_parity_test(item) and item.get_closest_marker("gpu") is None and item.get_closest_marker("cpu") is None:
            item.add_marker(getattr(pytest.mark, lane))


def cpu_threads() -> int:
    """The CPU lane's intra-op thread count: PARITY_CPU_THREADS, else 1."""
    text = os.environ.get(CPU_THREADS_ENV, "1")
    try:
        threads = int(text)
    except ValueError:
        raise pytest.UsageError(f"{CPU_THREADS_ENV}={text!r}: expected a positive integer") from None
    if threads < 1:
        raise pytest.UsageError(f"{CPU_THREADS_ENV}={text!r}: expected a positive integer")
    return threads


def set_cpu_threads() -> None:
    """The plugin owns the CPU lane's thread count: it overrides OMP_NUM_THREADS (which only sets
    torch's default) so that rows do not depend on how the shell was set up."""
    import torch

    torch.set_num_threads(cpu_threads())


def visible_gpus() -> list[str]:
    """The GPUs this process may use, without initialising CUDA: the outer CUDA_VISIBLE_DEVICES
    mask if one is set, else every GPU `nvidia-smi -L` lists."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        return [d.strip() for d in mask.split(",") if d.strip()]
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]


def pin_xdist_worker_to_gpu() -> str | None:
    """Give xdist worker `gwN` its own GPU (the N-th visible one, round robin), before CUDA starts.

    Every worker would otherwise default to cuda:0 and run out of memory there. Runs before
    anything touches CUDA; returns the device id chosen, or None.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    gpus = visible_gpus()
    if not worker.startswith("gw") or not gpus:
        return None
    chosen = gpus[int(worker[2:]) % len(gpus)]
    os.environ["CUDA_VISIBLE_DEVICES"] = chosen
    return chosen

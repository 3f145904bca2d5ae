"""Lanes: the markers, which tests the plugin acts on, the CPU lane's threads and xdist's GPUs.

The plugin is installed for every pytest session of an environment, so everything it adds is
namespaced (`parity_*` markers and fixtures) and it acts only on parity's own tests: those marked
`parity_suite(...)`, or every test when the rootdir's configuration says `parity_scope = "all"`
(this repository does, for its harness tests). On those it adds the lane marker of
`--parity-device` to unmarked tests (so `-m parity_cpu` / `-m parity_gpu` select lanes), sets the
CPU lane's thread count and resets Dynamo before each test; in any other session it changes nothing.
"""

from __future__ import annotations

import os
import subprocess

import pytest

CPU = "parity_cpu"
GPU = "parity_gpu"
SLOW = "parity_slow"
SUITE = "parity_suite"
KEEP_COMPILE_CACHE = "parity_keep_compile_cache"
COMPILES = "parity_compiles"
LANES = {"cpu": CPU, "cuda": GPU}  # --parity-device -> the lane marker its unmarked parity tests get
# pytest-benchmark registers its own `benchmark` marker; parity's benchmark suite uses that one.
MARKERS = {
    CPU: "needs no GPU; the CPU lane `pytest -m parity_cpu` (unmarked parity tests take the lane of --parity-device)",
    GPU: "needs a CUDA device; skipped with a reason when none is present",
    SLOW: "takes more than a few seconds on the CPU lane",
    f"{SUITE}(name)": "the report suite a test writes rows for (e.g. numerics, routing)",
    COMPILES: (
        "compiles with torch.compile whatever its mode: the run order puts it with the compiled modes, "
        "after every suite's eager and graph tests (parity/suites/conftest.py run_order)"
    ),
    KEEP_COMPILE_CACHE: (
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


# A repository that calls its lanes cpu / gpu / slow (this one) asks for these with the ini option
# `parity_short_lane_markers`: each parity lane marker also puts its short name on the test.
SHORT_LANES = {CPU: "cpu", GPU: "gpu", SLOW: "slow"}


def short_lanes(config: pytest.Config) -> bool:
    return bool(config.getini("parity_short_lane_markers"))


def register_markers(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if short_lanes(config):
        for lane, short in SHORT_LANES.items():
            config.addinivalue_line("markers", f"{short}: the short name of {lane} (parity_short_lane_markers)")


def ignore_torch_warnings(config: pytest.Config) -> None:
    """In a parity session only: warnings torch's own imports raise are not a suite's."""
    for warning in IGNORED_WARNINGS:
        config.addinivalue_line("filterwarnings", warning)


def suite_of(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker(SUITE)
    return marker.args[0] if marker and marker.args else None


def scope(config: pytest.Config) -> str:
    value = str(config.getini("parity_scope") or "").strip() or "suites"
    if value not in SCOPES:
        raise pytest.UsageError(f"ini option parity_scope = {value!r}: expected one of {', '.join(SCOPES)}")
    return value


def parity_session(config: pytest.Config) -> bool:
    """Whether the session is a parity one before anything is collected: the rootdir's
    configuration names `parity_scope` (a project with parity tests of its own says so once), or a
    `--parity-*` option is on the command line (`parity run` always passes one). Collecting
    `parity.suites` makes a session a parity one too (their conftest activates the plugin)."""
    return config.getini("parity_scope") is not None or any(str(a).startswith("--parity-") for a in config.invocation_params.args)


def is_parity_test(item: pytest.Item) -> bool:
    """Whether the plugin acts on `item` (see the module docstring)."""
    return suite_of(item) is not None or scope(item.config) == "all"


def mark_lanes(items: list[pytest.Item], device: str, *, short: bool = False) -> None:
    """Give unmarked parity tests the lane of `device`; with `short`, every lane marker of a parity
    test its short name too (before pytest's `-m` selects: its hook runs after the plugin's)."""
    lane = LANES[device]
    for item in items:
        if not is_parity_test(item):
            continue
        if item.get_closest_marker(GPU) is None and item.get_closest_marker(CPU) is None:
            item.add_marker(lane)
        for marker, name in SHORT_LANES.items() if short else ():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(name)


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
    from parity.observe.progress import run_watched

    try:
        listing = run_watched(["nvidia-smi", "-L"]).stdout  # stopped only when it stalls (docs/cli.md §9)
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

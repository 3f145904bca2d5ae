"""Facts about the environment a run happened in, for every report row and the run's `run.json`."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from parity.observe.progress import run_watched

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# ATen's kernel set below AVX-512 -> the matching cap for oneDNN (and the cpublas paths that ask
# oneDNN which ISA it runs): without it, ATEN_CPU_CAPABILITY=default on an AVX-512/AMX CPU makes
# bf16 scaled_dot_product_attention fail with "pack_vnni2 is only supported when avx512 is
# supported" (ATen takes its default path while oneDNN still picks AMX's VNNI packing).
# docs/cpu-kernels.md explains it.
ONEDNN_ISA_FOR_ATEN = {"default": "SSE41", "avx2": "AVX2"}
# Set (to the ATen value it answered) when parity capped oneDNN, so child processes and run.json say so.
ONEDNN_ALIGNED_ENV = "PARITY_ONEDNN_ISA_ALIGNED_TO"
CPU_KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS")


def align_onednn_isa(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Cap oneDNN's ISA to match `ATEN_CPU_CAPABILITY` when that is below AVX-512 and no cap is set.

    Must run before the first oneDNN kernel (importing torch is fine); the variable is inherited by
    xdist workers and every subprocess the suites start. Returns the cap it set, or None.
    """
    environ = os.environ if environ is None else environ
    marked = environ.get(ONEDNN_ALIGNED_ENV)
    if marked and environ.get("ONEDNN_MAX_CPU_ISA") != ONEDNN_ISA_FOR_ATEN.get(marked):
        del environ[ONEDNN_ALIGNED_ENV]  # inherited, but the cap in force now is someone else's
    capability = environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    cap = ONEDNN_ISA_FOR_ATEN.get(capability)
    if cap is None or environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA"):
        return None
    environ["ONEDNN_MAX_CPU_ISA"] = cap
    environ[ONEDNN_ALIGNED_ENV] = capability
    return cap


def isolate_inductor_cache(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Give Inductor its own cache directory per `ATEN_CPU_CAPABILITY` (unless one is set).

    Inductor's on-disk cache does not keep kernel sets apart: measured with torch 2.13, a compile
    under AVX-512 with 2 threads followed by one under `ATEN_CPU_CAPABILITY=default` with 2 threads
    in the same cache fails with "'at::vec' has not been declared" (docs/cpu-kernels.md).
    Processes on the machine's own kernel set keep Inductor's default directory. Inductor writes
    its default into TORCHINDUCTOR_CACHE_DIR the first time it is asked (importing torch._dynamo
    does), so that value counts as unset, and so does a directory this function chose for a parent
    process; any other value is the user's choice and is kept.
    """
    environ = os.environ if environ is None else environ
    capability = environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch layout: the same default, spelt out
        import getpass
        import tempfile

        def default_cache_dir() -> str:
            return os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser())

    default = default_cache_dir()
    current = environ.get("TORCHINDUCTOR_CACHE_DIR", default)
    if current != default and not current.startswith(f"{default}-aten-"):
        return None
    if not capability:
        if current != default:
            environ["TORCHINDUCTOR_CACHE_DIR"] = default
        return None
    path = f"{default}-aten-{capability}"
    environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def select_cpu_kernels(environ: MutableMapping[str, str] | None = None) -> None:
    """What a run does before any kernel runs when ATEN_CPU_CAPABILITY picks a kernel set."""
    align_onednn_isa(environ)
    isolate_inductor_cache(environ)


def cpu_kernels() -> dict[str, str]:
    """The CPU kernel set this process runs: ATen's capability and the variables that choose kernels."""
    import torch

    info = {"cpu_capability": torch.backends.cpu.get_cpu_capability()}
    info.update({name: os.environ.get(name, "") for name in CPU_KERNEL_ENV + ("TORCHINDUCTOR_CACHE_DIR",)})
    aligned = os.environ.get(ONEDNN_ALIGNED_ENV)
    if aligned and os.environ.get("ONEDNN_MAX_CPU_ISA") == ONEDNN_ISA_FOR_ATEN.get(aligned):
        info["note"] = (
            f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '')} set by parity to match "
            f"ATEN_CPU_CAPABILITY={aligned} (docs/cpu-kernels.md)"
        )
    return info


@functools.cache
def git_sha(root: Path = PROJECT_ROOT) -> str:
    """Short commit of the tree under test, with `-dirty` when it has uncommitted changes."""
    try:
        sha = run_watched(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, check=True).stdout.strip()
        dirty = run_watched(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


@functools.cache
def tree_digest(root: Path = PROJECT_ROOT) -> str:
    """What the harness under test is, as content: in a checkout, the tracked files as committed or
    staged (`git ls-files -s`) and the changes not yet staged (`git diff`), hashed; in an installed
    parity, its package files. Two shards of one run must come from the same tree (`parity merge`);
    a short commit with `-dirty` cannot say whether two dirty trees are the same."""
    import hashlib

    digest = hashlib.sha256()
    try:
        for args in (["ls-files", "-s"], ["diff", "--no-ext-diff", "--binary", "HEAD"]):
            digest.update(subprocess.run(["git", *args], cwd=root, capture_output=True, check=True, timeout=30).stdout)
        return "git:" + digest.hexdigest()[:16]
    except (OSError, subprocess.SubprocessError):
        package = Path(__file__).resolve().parent
        for path in sorted(package.rglob("*.py")):
            digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
        return "package:" + digest.hexdigest()[:16]


@functools.cache
def _packages_distributions() -> Mapping[str, list[str]]:
    """Top-level package -> installed distributions, read once per process: reading it walks every
    installed distribution's file list (0.2 s), and a process that runs many sessions (the
    sensitivity suite's children) would pay it for each one."""
    import importlib.metadata

    return importlib.metadata.packages_distributions()


def target_provenance(spec: str, factory: str) -> dict[str, str]:
    """Where the target under test comes from, for `run.json`: the `--target` value, its factory
    (`module:callable`), the module's file, the installed distribution and version that ship its
    top-level package (or the package's `__version__`), and the git commit of the checkout the
    file lives in ('' where there is none). Finds the module without running it (the suites do);
    only a top-level package without a distribution is imported, for its `__version__`."""
    import importlib
    import importlib.metadata
    import importlib.util

    module_name = factory.partition(":")[0]
    info = {"spec": spec, "factory": factory, "module": module_name, "file": "", "distribution": "", "version": "", "git_sha": ""}
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.origin or not os.path.isfile(found.origin):
        return info
    info["file"] = found.origin
    top = module_name.split(".")[0]
    distributions = _packages_distributions().get(top, [])
    if distributions:
        info["distribution"] = distributions[0]
        info["version"] = importlib.metadata.version(distributions[0])
    else:  # a checkout on the path: the package's own `__version__` (the run imports it anyway)
        try:
            info["version"] = str(getattr(importlib.import_module(top), "__version__", ""))
        except Exception:  # the run reports the import failure itself
            info["version"] = ""
    info["git_sha"] = _tracked_file_sha(Path(found.origin).resolve())
    return info


def _tracked_file_sha(path: Path) -> str:
    """The commit of the checkout `path` lives in, or '' outside any checkout or when git ignores
    the file (a virtual environment inside a checkout is not that checkout's code)."""
    try:
        ignored = run_watched(["git", "check-ignore", "-q", str(path)], cwd=path.parent).returncode
    except (OSError, subprocess.SubprocessError):
        return ""
    if ignored != 1:  # 0: ignored; 128: not in a work tree
        return ""
    sha = git_sha(path.parent)
    return "" if sha == "unknown" else sha


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
        "cpu_kernels": cpu_kernels(),
    }
    return info

"""The pytest plugin of the parity harness: options, markers, lanes, fixtures and report rows.

Loaded by the top-level `conftest.py`. A suite asks for the `report` fixture and writes its rows
through it; the plugin fills the run's context (run id, target, device, dtype, size, versions),
turns a recorded failure into a failed test, and turns a check that raised into an `error` row, so
the CSV holds every outcome. Under pytest-xdist the controller chooses the run directory and hands
it to the workers; all processes append to the same `results.csv` (see `parity.report`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from parity import env
from parity.cases import CaseFileError
from parity.compare import ERROR, FAIL, PASS, TreeDiff, TensorDiff, Verdict
from parity.report import (
    RESULTS_FILE,
    ReportWriter,
    format_summary,
    make_run_dir,
    new_run_id,
    read_results,
    summarize,
    write_run_info,
)

MARKERS = {
    "cpu": "needs no GPU; the CI lane `pytest -m cpu` (unmarked tests take the lane of --device)",
    "gpu": "needs a CUDA device; skipped with a reason when none is present",
    "slow": "takes more than a few seconds on the CPU lane",
    "benchmark": "a pytest-benchmark measurement; run without xdist (`-p no:xdist`)",
    "suite(name)": "the report suite a test writes rows for (e.g. numerics, routing)",
    "keep_compile_cache": (
        "skip the per-test Dynamo reset: for parity tests that compare outputs of the same compiled "
        "functions (reuse cannot hide a parity failure; guards still hold) and must not recompile them"
    ),
}
DEFAULT_DTYPE = {"cpu": "fp32", "cuda": "bf16"}
# Tiny CPU models run faster on one thread than on two contended ones (a tiny forward: ~1.5 ms vs
# ~200 ms on a shared 2-core box), and a fixed thread count keeps reductions, hence rows, the same
# between serial and xdist runs. PARITY_CPU_THREADS overrides it.
CPU_THREADS_ENV = "PARITY_CPU_THREADS"
DEFAULT_REPORT_DIR = env.PROJECT_ROOT / "reports" / "runs"
_RUN_DIR = pytest.StashKey[Path]()
_WRITER = pytest.StashKey[ReportWriter]()


# ---------------------------------------------------------------------------------------------
# Options and configuration
# ---------------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("parity", "parity harness")
    group.addoption("--device", choices=("cpu", "cuda"), default="cpu", help="device the suites run on (default cpu)")
    group.addoption("--size", choices=("tiny", "full"), default="tiny", help="model configuration size (default tiny)")
    group.addoption(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="dtype of the target under test (default: fp32 on cpu, bf16 on cuda)",
    )
    group.addoption(
        "--target",
        default="serving",
        help="implementation under test: serving (built-in), reference, or package.module:factory",
    )
    group.addoption(
        "--report-dir",
        default=None,
        help=f"directory that receives one run directory per run (default {DEFAULT_REPORT_DIR})",
    )
    group.addoption("--run-id", default=None, help="name of this run's directory (default: timestamp + random)")
    group.addoption(
        "--seed",
        type=int,
        default=0,
        help="offset added to every case seed and checkpoint seed (default 0): the same suites on other random models",
    )
    group.addoption("--no-parity-summary", action="store_true", help=argparse.SUPPRESS)  # parity run prints its own
    group.addoption(
        "--suite",
        action="append",
        default=[],
        metavar="NAME",
        help="run only tests of this report suite (repeatable), e.g. --suite numerics",
    )


class _XdistHooks:
    """Registered only when pytest-xdist is active: hands the run directory to every worker."""

    def __init__(self, config: pytest.Config):
        self.config = config

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput["parity_run_dir"] = str(self.config.stash[_RUN_DIR])


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


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


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    # Before any kernel runs: oneDNN's ISA follows ATEN_CPU_CAPABILITY, and Inductor gets a cache
    # of its own per kernel set (docs/cpu-kernels.md).
    env.select_cpu_kernels()
    device = config.getoption("--device")
    if device == "cuda":
        pin_xdist_worker_to_gpu()
    import torch

    if device == "cpu":
        # The plugin owns the CPU lane's thread count: it overrides OMP_NUM_THREADS (which only sets
        # torch's default) so that rows do not depend on how the shell was set up.
        torch.set_num_threads(cpu_threads())
    if device == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda: no CUDA device is available on this machine")
    if _is_worker(config):
        run_dir = Path(config.workerinput["parity_run_dir"])
    else:
        base = config.getoption("--report-dir") or DEFAULT_REPORT_DIR
        run_dir = make_run_dir(base, config.getoption("--run-id") or new_run_id())
        info = {"run_id": run_dir.name, "args": config.invocation_params.args, **env.describe(device)}
        info.update(
            size=config.getoption("--size"),
            dtype=_dtype_name(config),
            target=config.getoption("--target"),
            seed=config.getoption("--seed"),
        )
        write_run_info(run_dir, info)
        if config.pluginmanager.hasplugin("xdist"):
            config.pluginmanager.register(_XdistHooks(config), "parity-xdist")
    config.stash[_RUN_DIR] = run_dir
    config.stash[_WRITER] = ReportWriter(
        run_dir,
        {
            "run_id": run_dir.name,
            "target": config.getoption("--target"),
            "device": device,
            "dtype": _dtype_name(config),
            "size": config.getoption("--size"),
            "torch_version": env.torch_version(),
            "git_sha": env.git_sha(),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        },
    )


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


def pytest_report_header(config: pytest.Config) -> list[str]:
    """One line (controller only) naming the CPU kernel set, and saying when parity capped oneDNN."""
    if config.getoption("--device") != "cpu":
        return []
    kernels = env.cpu_kernels()
    chosen = " ".join(f"{k}={v}" for k, v in kernels.items() if k in env.CPU_KERNEL_ENV and v)
    line = f"parity: CPU kernels {kernels['cpu_capability']}, {cpu_threads()} thread(s)" + (f"; {chosen}" if chosen else "")
    return [line] + ([f"parity: {kernels['note']}"] if "note" in kernels else [])


def _dtype_name(config: pytest.Config) -> str:
    return config.getoption("--dtype") or DEFAULT_DTYPE[config.getoption("--device")]


def _suite_of(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("suite")
    return marker.args[0] if marker and marker.args else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give unmarked tests the lane of --device, then apply --suite selection."""
    lane = "gpu" if config.getoption("--device") == "cuda" else "cpu"
    for item in items:
        if item.get_closest_marker("gpu") is None and item.get_closest_marker("cpu") is None:
            item.add_marker(getattr(pytest.mark, lane))
    wanted = set(config.getoption("--suite"))
    if wanted:
        keep, drop = [], []
        for item in items:
            (keep if _suite_of(item) in wanted else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("gpu test: no CUDA device on this machine (torch.cuda.is_available() is False)")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[Any]:
    """A malformed case file is one readable line (file, table, key), not a loader traceback."""
    report = yield
    if report.failed and report.longrepr is not None:
        marker = f"{CaseFileError.__name__}: "
        lines = [line for line in str(report.longrepr).splitlines() if marker in line]
        if lines:
            report.longrepr = lines[-1].split(marker, 1)[1].strip()
    return report


# ---------------------------------------------------------------------------------------------
# The per-test report
# ---------------------------------------------------------------------------------------------


class SuiteReport:
    """Writes a test's rows for its suite and remembers which of them failed.

    `verdict()` and `record()` write immediately; a failing gate row makes the test fail when it
    returns (the row is already on disk), so a suite can record every layer before it fails.
    """

    def __init__(self, writer: ReportWriter, suite: str, test: str, default_case: str):
        self.writer = writer
        self.suite = suite
        self.test = test
        self.case = default_case
        self.mode = "eager"
        self.seed: int | None = None
        self.rows: list[dict[str, Any]] = []

    def record(
        self,
        *,
        metric: str,
        value: float | int | None,
        verdict: str = PASS,
        threshold: float | None = None,
        detail: str = "",
        case: str | None = None,
        mode: str | None = None,
        site: str = "",
        seed: int | None = None,
        kind: str = "gate",
        better: str = "lower",
        suite: str | None = None,
        bound: str | None = None,
    ) -> dict[str, Any]:
        """Write one row now. `bound`: `measured` when `threshold` was derived from noise measured in
        this run; by default a threshold is `fixed` (a policy)."""
        if case is not None:
            self.case = case
        if mode is not None:
            self.mode = mode
        row = self.writer.write(
            {
                "suite": suite or self.suite,
                "case": self.case,
                "mode": self.mode,
                "site": site,
                "metric": metric,
                "value": value,
                "threshold": threshold,
                "verdict": verdict,
                "detail": detail,
                "seed": self.seed if seed is None else seed,
                "kind": kind,
                "better": better,
                "bound": bound,
                "test": self.test,
            }
        )
        self.rows.append(row)
        return row

    def verdict(self, verdict: Verdict, *, better: str = "lower", **where: Any) -> Verdict:
        """Write the gate row of a `Verdict`; returns it so a caller can branch on `.ok`."""
        self.record(
            metric=verdict.metric,
            value=verdict.value,
            verdict=verdict.verdict,
            threshold=verdict.threshold,
            detail=verdict.detail,
            better=better,
            bound=verdict.bound,
            **where,
        )
        return verdict

    def info(self, *, metric: str, value: float | int | None, detail: str = "", verdict: str = PASS, **where: Any) -> None:
        """A number recorded beside a decision (it does not decide a case)."""
        where.setdefault("better", "")
        self.record(metric=metric, value=value, verdict=verdict, detail=detail, kind="info", **where)

    def diff(
        self,
        measured: TensorDiff | TreeDiff,
        *,
        gate: str = "max_abs",
        info: tuple[str, ...] = ("mean_abs", "rel_l2", "cosine", "max_ulp"),
        **where: Any,
    ) -> Verdict:
        """Gate row on `gate` plus info rows for the other metrics of a diff."""
        verdict = self.verdict(measured.verdict(gate), **where)
        if isinstance(measured, TreeDiff):
            leaf = measured.first_failing() or measured.worst(gate)
        else:
            leaf = measured
        if leaf is not None:
            for metric in info:
                value = getattr(leaf, metric)
                if value is not None:
                    better = "higher" if metric in ("cosine", "argmax_agree", "topk_agree") else "lower"
                    self.info(metric=metric, value=value, verdict=verdict.verdict, detail=leaf.name, better=better, **where)
        return verdict

    @contextlib.contextmanager
    def guard(self, *, case: str, mode: str | None = None, site: str = "") -> Iterator[None]:
        """Turn an exception inside the block into an `error` row for `case` and carry on, so one
        broken case does not hide the rows of the others (the test still fails at the end)."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - the row is the report of it
            message = f"{type(exc).__name__}: {exc}".replace("\n", " | ")[:2000]
            self.record(case=case, mode=mode, site=site, metric="exception", value=None, verdict=ERROR, detail=message)

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["kind"] == "gate" and r["verdict"] in (FAIL, ERROR)]

    def failure_text(self) -> str:
        lines = [
            f"{r['suite']}/{r['case']}/{r['mode']}: {r['metric']}={r['value']} "
            f"(threshold {r['threshold']}) {r['verdict']}: {r['detail']}"
            for r in self.failures
        ]
        return f"{len(lines)} failing report row(s):\n" + "\n".join(lines)


_REPORT = pytest.StashKey[SuiteReport]()


def _default_case(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    return callspec.id if callspec is not None else item.name


@pytest.fixture
def report(request: pytest.FixtureRequest) -> SuiteReport:
    """The row writer of this test's suite (declared with `pytest.mark.suite("name")`)."""
    suite = _suite_of(request.node)
    if not suite:
        raise pytest.UsageError(
            f"{request.node.nodeid} uses the report fixture but declares no suite: "
            "add pytestmark = pytest.mark.suite('<name>') to its module"
        )
    rep = SuiteReport(request.config.stash[_WRITER], suite, request.node.nodeid, _default_case(request.node))
    request.node.stash[_REPORT] = rep
    return rep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Every failure reaches the CSV: a raised check becomes an `error` row, a bare assert a `fail`
    row, and a recorded failing row fails a test that would otherwise have passed."""
    try:
        result = yield
    except BaseException as exc:
        rep = item.stash.get(_REPORT, None)
        if rep is not None and not rep.failures and not isinstance(exc, (pytest.skip.Exception, KeyboardInterrupt)):
            is_assert = isinstance(exc, AssertionError)
            message = f"{type(exc).__name__}: {exc}".strip()
            rep.record(
                metric="assertion" if is_assert else "exception",
                value=None,
                verdict=FAIL if is_assert else ERROR,
                detail=message.replace("\n", " | ")[:2000],
            )
        raise
    rep = item.stash.get(_REPORT, None)
    if rep is not None and rep.failures:
        raise AssertionError(rep.failure_text())
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[Any]:
    """A suite test whose setup failed (a model that would not load, a fixture that raised) still
    leaves an `error` row, so a run's CSV accounts for every test of a suite."""
    report = yield
    suite = _suite_of(item)
    if report.when == "setup" and report.failed and suite and call.excinfo is not None:
        exc = call.excinfo.value
        message = f"setup failed: {type(exc).__name__}: {exc}".replace("\n", " | ")[:2000]
        item.config.stash[_WRITER].write(
            {"suite": suite, "case": _default_case(item), "metric": "exception", "value": None,
             "verdict": ERROR, "detail": message, "test": item.nodeid}
        )
    return report


# ---------------------------------------------------------------------------------------------
# Fixtures a suite uses
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The options of this run, as one object a suite can pass around."""

    device: str
    size: str
    dtype: str
    target: str
    run_dir: Path
    seed: int = 0

    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]


@pytest.fixture(scope="session")
def settings(pytestconfig: pytest.Config) -> RunSettings:
    return RunSettings(
        device=pytestconfig.getoption("--device"),
        size=pytestconfig.getoption("--size"),
        dtype=_dtype_name(pytestconfig),
        target=pytestconfig.getoption("--target"),
        run_dir=pytestconfig.stash[_RUN_DIR],
        seed=pytestconfig.getoption("--seed"),
    )


@pytest.fixture(scope="session")
def run_dir(settings: RunSettings) -> Path:
    """This run's directory: results.csv, images and the review page go here."""
    return settings.run_dir


@pytest.fixture(scope="session")
def device(settings: RunSettings) -> Any:
    import torch

    return torch.device(settings.device)


@pytest.fixture(autouse=True)
def fresh_compile_state(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test starts with an empty Dynamo cache: a test that expects "one compile on the first
    shape" must not pass or fail because of what an earlier test compiled (vllm-omni#7455).
    Tests marked `keep_compile_cache` (output comparisons only) opt out."""
    if request.node.get_closest_marker("keep_compile_cache") is None:
        from parity.observe.compile_ledger import reset_compile_state

        reset_compile_state()
    yield


@pytest.fixture(scope="session")
def target(settings: RunSettings) -> Any:
    """The implementation under test, resolved from --target (see parity.target)."""
    from parity.target import load_target

    return load_target(settings.target)


# ---------------------------------------------------------------------------------------------
# End of run
# ---------------------------------------------------------------------------------------------


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _is_worker(config) or config.getoption("--no-parity-summary"):
        return
    run_dir = config.stash.get(_RUN_DIR, None)
    if run_dir is None or not (run_dir / RESULTS_FILE).exists():
        return
    frame = read_results(run_dir)
    terminalreporter.section("parity report")
    terminalreporter.write_line(format_summary(summarize(frame)))
    terminalreporter.write_line(f"{len(frame)} rows in {run_dir / RESULTS_FILE}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove a run directory that received no rows (a plain test run), keep every other one."""
    if _is_worker(config):
        return
    run_dir = config.stash.get(_RUN_DIR, None)
    if run_dir is not None and run_dir.exists() and not (run_dir / RESULTS_FILE).exists():
        leftovers = [p for p in run_dir.iterdir() if p.name != "run.json"]
        if not leftovers:
            shutil.rmtree(run_dir, ignore_errors=True)

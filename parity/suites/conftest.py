"""What every parity suite shares: execution modes by device, and skipping modes a target lacks.

A test that takes a `mode` argument is parametrized over the modes of `--device`
(`parity.runners.modes_for`: eager, cpu_graph, compiled on the CPU; eager, cuda_graph, compiled,
compiled_cuda_graph on CUDA). Model fixtures live in the family support modules
(`parity/suites/ar/support.py`, `parity/suites/dit/support.py`, `parity/suites/routing/support.py`); the model
fixtures are registered here, once (a fixture imported into each test module would be a separate
fixture per module, built once per module).

At full size the device holds one family at a time (the AR pair with its streamed fp64 golden is
about 46 GiB, the DiT trio about 25 GB), so the models live in `RESIDENT`, which keeps every family
at tiny size and only the family in use at full size; tests are ordered so each family's tests run
together (one build per family and session). A family the card cannot hold skips its tests with
the need and the card (`parity/suites/device_memory.py`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
import pytest
import torch

from parity.compare.verdict import SKIP
from parity.plugin import activate
from parity.plugin.hooks import resumed_test_ids, writes_session_rows
from parity.plugin.lanes import COMPILES, KEEP_COMPILE_CACHE, suite_of
from parity.plugin.report_fixture import SESSION, WRITER
from parity.plugin.session import RunSession, option, session_target
from parity.plugin.short_names import device, report, run_dir, settings, target  # noqa: F401 - this folder's fixture names
from parity.report import NOT_PROVIDED, not_provided_lines
from parity.runners import modes_for
from parity.suites.ar.support import build_ar_models
from parity.suites.device_memory import DeviceMemoryError
from parity.suites.dit.support import build_dit_models
from parity.suites.families import require_family
from parity.target import FAMILIES, PLANTED_SUITE, Target, TargetError, family_missing, not_selected, suite_plan

SUITES_DIR = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    """Collecting the suites makes the session a parity one, options or not
    (`pytest --pyargs parity.suites`)."""
    activate(config)


def _parametrizes(metafunc: pytest.Metafunc, name: str) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mode" in metafunc.fixturenames and not _parametrizes(metafunc, "mode"):
        metafunc.parametrize("mode", modes_for(metafunc.config.getoption("--parity-device")))


def family_of(item: pytest.Item) -> str | None:
    """The model family of a suite test: its directory under `parity/suites/` (ar, dit, routing, ...)."""
    try:
        return Path(str(item.path)).resolve().relative_to(SUITES_DIR).parts[0]
    except (ValueError, IndexError):
        return None


@pytest.hookimpl(trylast=True)  # after the lane marks, --parity-suite and --parity-append have selected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the tests (`run_order`), then leave out the tests the target's plan does not run (a family
    it does not provide, the mutant catalogue for a target other than the built-in one): they are
    deselected, and each (suite, family) left out is one `not_provided` row with the reason and the
    number of tests, where a skip per test once gave an AR-only target 743 skip rows. The plan is
    `parity.target.suite_plan`, the one `parity check-target` prints."""
    _order_by_family(items, by_family=option(config, "size") == "full")
    _catalogue_of_this_tp(config, items)
    try:
        target = session_target(config)
    except TargetError:
        return  # reported once, up front, by the plugin
    # the benchmarks by their marker, the planted catalogue by --parity-mutants (parity.plugin.hooks)
    plans = suite_plan(target, option(config, "target"), benchmarks=True, mutants=True)
    left_out: dict[tuple[str, str], list[pytest.Item]] = {}
    for item in items:
        suite, family = suite_of(item), family_of(item) or "-"
        if suite is not None and not_selected(plans, suite, family) is not None:
            left_out.setdefault((suite, family), []).append(item)
    if not left_out:
        return
    dropped = {id(item) for group in left_out.values() for item in group}
    config.hook.pytest_deselected(items=[item for group in left_out.values() for item in group])
    items[:] = [item for item in items if id(item) not in dropped]
    if not items:  # the plan leaves out all that was selected: said, and no run directory for rows of nothing run
        _say_nothing_runs(config, plans, left_out)
    elif writes_session_rows(config):
        _record_left_out(config, plans, left_out, target)


NOT_RUN = pytest.StashKey[list[str]]()  # the `not run:` lines of a session the plan left nothing to run
WORKER_NOT_RUN = "parity_not_run"  # the same lines, from an xdist worker to the controller (workeroutput)


def _say_nothing_runs(config: pytest.Config, plans: list[Any], left_out: dict[tuple[str, str], list[pytest.Item]]) -> None:
    """The `not run:` lines of the summary (docs/cli.md §1), printed at the end of a session that
    runs nothing because the target provides none of the selected suites' families: pytest then
    exits 5 (nothing selected) and, with no row written, leaves no run directory."""
    records = [
        {
            "suite": suite,
            "case": family,
            "value": len(tests),
            "detail": not_selected(plans, suite, family),
            "metric": NOT_PROVIDED,
        }
        for (suite, family), tests in left_out.items()
    ]
    lines = not_provided_lines(pd.DataFrame(records))
    config.stash[NOT_RUN] = lines
    if hasattr(config, "workeroutput"):
        config.workeroutput[WORKER_NOT_RUN] = lines


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist's controller: a worker's `not run:` lines (the controller collects nothing)."""
    lines = getattr(node, "workeroutput", {}).get(WORKER_NOT_RUN)
    if lines:
        node.config.stash[NOT_RUN] = list(lines)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    for line in config.stash.get(NOT_RUN, []):
        terminalreporter.write_line(line)


def _catalogue_of_this_tp(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A run checks the mutants of its own tensor-parallel size (the sharding mutants at --tp 2,
    the others in one process), and in a tensor-parallel run only rank 0 runs the catalogues (the
    built-in one and the planted one): their sessions use no collective of the run's, and each
    sharded session starts its own ranks."""
    from parity.plugin.ranks import this_rank
    from parity.suites.sensitivity.catalogue import applies_at, lane_of
    from parity.suites.sensitivity.runs import CATALOGUE, PLANTED_MODULE, SENSITIVITY_MODULE

    run = config.stash[SESSION]
    lane = lane_of(run.device)

    def kept(item: pytest.Item) -> bool:
        if item.path.name == PLANTED_MODULE:  # planted before sharding: every mutant at any size, on rank 0
            return this_rank() == 0
        if item.path.name != SENSITIVITY_MODULE:
            return True
        if this_rank() != 0:
            return False
        name = getattr(item, "callspec", None) and item.callspec.params.get("name")
        return not name or applies_at(CATALOGUE[name], lane, run.tp)

    dropped = [item for item in items if not kept(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if kept(item)]


def _record_left_out(
    config: pytest.Config, plans: list[Any], left_out: dict[tuple[str, str], list[pytest.Item]], resolved: Target
) -> None:
    done = resumed_test_ids(config)
    for (suite, family), tests in left_out.items():
        test_id = f"{SUITES_DIR.name}/{family}::{suite}"  # one per (family, suite): an appended run writes it once
        if test_id in done:
            continue
        missing = family_missing(resolved, family)  # the page names the family and what the target lacks (docs/reports.md §4)
        config.stash[WRITER].write(
            {
                "suite": suite,
                "case": family,
                "metric": NOT_PROVIDED,
                "value": len(tests),
                "verdict": SKIP,
                "detail": not_selected(plans, suite, family),
                "kind": "info",
                "better": "",
                "test": test_id,
                "data": {"what": FAMILIES[family].what, "missing": missing} if missing else None,
            }
        )


def require_graph_support(adapter: object, mode: str) -> None:
    """Skip graph modes for a target that cannot be captured (the reference reads masks on the host)."""
    if mode != "eager" and not getattr(adapter, "supports_capture", True):
        pytest.skip(f"{adapter.name} target does not support capture (supports_capture=False): mode {mode} does not apply")


class ResidentModels:
    """Built model families, each built once; at full size only one family stays resident. A family
    the device cannot hold is refused once (`DeviceMemoryError`, raised again for each later test
    without building anything)."""

    def __init__(self) -> None:
        self.families: dict[str, Any] = {}
        self.refused: dict[str, DeviceMemoryError] = {}

    def get(self, family: str, build: Callable[[], Any], *, exclusive: bool) -> Any:
        if family in self.refused:
            raise self.refused[family]
        if family not in self.families:
            if exclusive:
                self.release()
            try:
                self.families[family] = build()
            except DeviceMemoryError as err:
                self.refused[family] = err
                raise
        return self.families[family]

    def release(self) -> None:
        self.families.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


RESIDENT = ResidentModels()
FAMILY_ORDER = tuple(family.fixture for family in FAMILIES.values() if family.fixture)
# The order the suites run in: the cheapest, most telling first, so that a defect is printed
# (parity.plugin.live) seconds into a run. Numerics in eager is one forward against the fp64
# golden and finds most numeric defects; expert selection's and numerics' compiled modes are
# Inductor compiles (seconds per shape class, the run's slowest tests) and run after every
# suite's eager and graph modes; the mutant catalogues only wait for sessions running beside.
SUITE_ORDER = (
    "numerics",
    "embedding_clamp",
    "fail_closed_capture",
    "expert_selection",
    "decode",
    "sampler",
    "image",
    "weight_coverage",
    "routing",
    "selfcheck",
    "recompiles",
)
CATALOGUE_SUITES = ("sensitivity", PLANTED_SUITE, "benchmark")  # last: they collect what ran beside
MODE_TIERS = {"eager": 0, "cpu_graph": 1, "cuda_graph": 1, "compiled": 2, "compiled_cuda_graph": 2}


def run_order(item: pytest.Item, *, by_family: bool) -> tuple[int, ...]:
    """Where `item` runs (ascending; ties keep collection order): every suite's eager tests, then
    their graph modes, then whatever compiles (the compiled modes, and tests marked
    `parity_compiles`), each tier in `SUITE_ORDER`; the mutant catalogues last. `by_family`: one
    model family after the other (at full size the device holds one family at a time: one build
    per family); at tiny size every family stays resident and the tiers run across them.

    The compiling tests that share compiled code (`parity_keep_compile_cache`) run together, after
    the other compiling tests: no test starting from an empty Dynamo cache runs between them and
    throws their compiles away (docs/capture-and-compile.md §3)."""
    names = getattr(item, "fixturenames", ())
    family = next((i for i, name in enumerate(FAMILY_ORDER) if name in names), len(FAMILY_ORDER))
    suite = suite_of(item)
    params = getattr(getattr(item, "callspec", None), "params", {})
    mode = params.get("mode") if isinstance(params.get("mode"), str) else None
    compiles = item.get_closest_marker(COMPILES) is not None
    tier = MODE_TIERS.get(mode, 0) if mode is not None else 2 if compiles else 0
    shares_compiles = tier == 2 and item.get_closest_marker(KEEP_COMPILE_CACHE) is not None
    priority = SUITE_ORDER.index(suite) if suite in SUITE_ORDER else len(SUITE_ORDER)
    return (family if by_family else 0, suite in CATALOGUE_SUITES, tier, shares_compiles, priority)


def _order_by_family(items: list[pytest.Item], *, by_family: bool = True) -> None:
    """Run the tests in `run_order` (a stable sort: file order inside each place)."""
    items.sort(key=lambda item: run_order(item, by_family=by_family))


@pytest.fixture(scope="session", autouse=True)
def _sensitivity_sessions_early(request: pytest.FixtureRequest, parity_settings: Any, tmp_path_factory: pytest.TempPathFactory):
    """A serial run with a spare core starts the sensitivity suite's isolated sessions at its
    first test, so they run beside the other suites (`parity/suites/sensitivity/runs.py`)."""
    from parity.suites.sensitivity.runs import start_early

    with start_early(request.session, parity_settings, tmp_path_factory):
        yield


def resident_or_skip(request: pytest.FixtureRequest, family: str, build: Callable[[], Any], *, exclusive: bool) -> Any:
    """`RESIDENT.get`, or, when the device cannot hold the family (`DeviceMemoryError`), a skip
    with the need and the card, and a `family_not_provided` row for the test, so the run's summary
    says under its table which family did not run and why (`parity.report.rows.not_provided_lines`)."""
    try:
        return RESIDENT.get(family, build, exclusive=exclusive)
    except DeviceMemoryError as err:
        writer = request.config.stash.get(WRITER, None)
        suite = suite_of(request.node)
        if writer is not None and suite is not None:
            row = {"suite": suite, "case": family, "metric": NOT_PROVIDED, "value": 1, "verdict": SKIP, "detail": str(err)}
            writer.write({**row, "kind": "info", "better": "", "test": request.node.nodeid})
        pytest.skip(str(err))


Models = TypeVar("Models")


def family_models(key: str, build: Callable[[RunSession, Target, pytest.TempPathFactory], Models]) -> Callable[..., Models]:
    """The fixture `FAMILIES[key].fixture` (`ar_models`, ...): the family's target, reference and
    golden from `build(settings, target, tmp_path_factory)`, built once per session while resident;
    a target that does not provide the family skips with `family_gap`'s reason."""

    def models(
        request: pytest.FixtureRequest,
        parity_settings: RunSession,
        parity_target: Target,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> Models:
        require_family(parity_target, key)
        built = lambda: build(parity_settings, parity_target, tmp_path_factory)
        return resident_or_skip(request, key, built, exclusive=parity_settings.size == "full")

    models.__doc__ = f"The {FAMILIES[key].name} target, reference and golden (built once per session while resident)."
    return pytest.fixture(name=FAMILIES[key].fixture)(models)


ar_models = family_models("ar", build_ar_models)
dit_models = family_models("dit", build_dit_models)

"""The per-test row writer (`parity_report`) and the fixtures a suite uses (`parity_settings`,
`parity_run_dir`, `parity_device`, `parity_target`), plus the fresh Dynamo cache every parity test
starts with. Namespaced, so they never shadow a project's own `report` or `device`; parity's own
test folders use the short names (`parity.plugin.short_names`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from parity.compare import ERROR, FAIL, PASS, TensorDiff, TreeDiff, Verdict
from parity.compare.metrics import default_better
from parity.observe.origin import error_line
from parity.plugin.lanes import KEEP_COMPILE_CACHE, SUITE, is_parity_test, suite_of
from parity.plugin.session import RunSession, session_target
from parity.report import ReportWriter
from parity.report.case_lines import LINE_CHARS, split_rule
from parity.target import Target

SESSION = pytest.StashKey[RunSession]()
WRITER = pytest.StashKey[ReportWriter]()
REPORT = pytest.StashKey["SuiteReport"]()


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
        data: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Write one row now. `bound`: `measured` when `threshold` was derived from noise measured in
        this run; by default a threshold is `fixed` (a policy). `data`: what a reader needs as
        numbers rather than prose (docs/reports.md §4: `parity.report.schema.DATA_KEYS`)."""
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
                "data": data,
            }
        )
        self.rows.append(row)
        return row

    def verdict(self, verdict: Verdict, *, better: str | None = None, **where: Any) -> Verdict:
        """Write the gate row of a `Verdict`; returns it so a caller can branch on `.ok`.

        The row's `better` is the verdict's own (`Verdict.better`: the rule that made it knows
        whether its value is better lower, higher or equal). `better` overrides it only for a
        `Verdict` built by hand without one; a rule's verdict needs none."""
        self.record(
            metric=verdict.metric,
            value=verdict.value,
            verdict=verdict.verdict,
            threshold=verdict.threshold,
            detail=verdict.detail,
            better=verdict.better if better is None else better,
            bound=verdict.bound,
            data={"rule": verdict.rule} if verdict.rule else None,
            **where,
        )
        return verdict

    def info(self, *, metric: str, value: float | int | None, detail: str = "", verdict: str = PASS, **where: Any) -> None:
        """A number recorded beside a decision (it does not decide a case). No rule decided it, so
        its direction is the metrics table's (`parity.compare.metrics`; '' for a metric without one
        or one the table does not know); `better=` overrides it."""
        where.setdefault("better", default_better(metric))
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
                    self.info(metric=metric, value=value, verdict=verdict.verdict, detail=leaf.name, **where)
        return verdict

    @contextlib.contextmanager
    def guard(self, *, case: str, mode: str | None = None, site: str = "") -> Iterator[None]:
        """Turn an exception inside the block into an `error` row for `case` and carry on, so one
        broken case does not hide the rows of the others (the test still fails at the end)."""
        try:
            yield
        except Exception as exc:
            message = error_line(exc)  # the type, where in the target's code it went wrong, the message
            self.record(case=case, mode=mode, site=site, metric="exception", value=None, verdict=ERROR, detail=message)
            from parity.plugin import ranks

            if ranks.ACTIVE is not None and ranks.raised_by_a_collective(exc, exc.__traceback__):
                raise  # a tensor-parallel group that lost a rank fails every later case: the session stops (ranks.py)

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["kind"] == "gate" and r["verdict"] in (FAIL, ERROR)]

    def failure_text(self) -> str:
        """The test's failing rows, one line each (at most `LINE_CHARS`); a tolerance rule's
        paragraph once, after them (docs/reports.md §5)."""
        lines, rules = [], []
        for r in self.failures:
            text, rule = split_rule(str(r["detail"]), r.get("data"))
            if rule and rule not in rules:
                rules.append(rule)
            at = f" @{r['site']}" if r.get("site") else ""
            ref = f", rule {rules.index(rule) + 1}" if rule else ""
            where = f"{r['suite']}/{r['case']}/{r['mode']}{at}"
            if r["verdict"] == ERROR:
                line = f"{where}: {r['metric']}: {text}"
            else:
                bound = f"bound {_short(r['threshold'])}" if r["threshold"] not in (None, "") else "no bound"
                line = f"{where}: {r['metric']}={_short(r['value'])} ({bound}{ref}) {r['verdict']}: {text}"
            lines.append(line if len(line) <= LINE_CHARS else line[: LINE_CHARS - 3] + "...")
        rules_text = "".join(f"\nrule {i}: {rule}" for i, rule in enumerate(rules, start=1))
        return f"{len(lines)} failing report row(s):\n" + "\n".join(lines) + rules_text


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def default_case(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    return callspec.id if callspec is not None else item.name


@pytest.fixture
def parity_report(request: pytest.FixtureRequest) -> SuiteReport:
    """The row writer of this test's suite (declared with `pytest.mark.parity_suite("name")`)."""
    suite = suite_of(request.node)
    if not suite:
        raise pytest.UsageError(
            f"{request.node.nodeid} uses the report fixture but declares no suite: "
            f"add pytestmark = pytest.mark.{SUITE}('<name>') to its module"
        )
    rep = SuiteReport(request.config.stash[WRITER], suite, request.node.nodeid, default_case(request.node))
    request.node.stash[REPORT] = rep
    return rep


@pytest.fixture(scope="session")
def parity_settings(pytestconfig: pytest.Config) -> RunSession:
    """The run's options (device, size, dtype, target, run_dir, seed), read once."""
    return pytestconfig.stash[SESSION]


@pytest.fixture(scope="session")
def parity_run_dir(parity_settings: RunSession) -> Path:
    """This run's directory: results.csv, images and the review page go here (made at the first row)."""
    return parity_settings.run_dir


@pytest.fixture(scope="session")
def parity_device(parity_settings: RunSession) -> Any:
    """The run's torch device (--parity-device)."""
    import torch

    return torch.device(parity_settings.device)


@pytest.fixture(scope="session")
def parity_target(pytestconfig: pytest.Config) -> Target:
    """The implementation under test, resolved once from --parity-target (see parity.target); the
    plugin resolves it up front when the session selects a parity test."""
    return session_target(pytestconfig)


_AFTER_KEEP = [False]  # whether this process's previous parity test kept the compile cache


@pytest.fixture(autouse=True)
def parity_fresh_compile_state(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every parity test starts with an empty Dynamo cache: a test that expects "one compile on the
    first shape" must not pass or fail because of what an earlier test compiled (vllm-omni#7455).
    Tests marked `parity_keep_compile_cache` (output comparisons only) keep what the marked tests
    right before them compiled, and only that: the first of a run of them starts empty too. Tests
    the plugin does not act on (another project's, in the same environment) are left alone."""
    if is_parity_test(request.node):
        keep = request.node.get_closest_marker(KEEP_COMPILE_CACHE) is not None
        if not (keep and _AFTER_KEEP[0]):
            from parity.observe.compile_ledger import reset_compile_state

            reset_compile_state()
        _AFTER_KEEP[0] = keep
    yield

"""recompiles (AR rows): how the compiled mode was compiled, over a lattice of batch sizes and lengths.

A serving engine compiles the AR step once, with dynamic shapes, and serves every batch and
length from that graph. A runner that compiles with `dynamic=False` (or with automatic dynamic,
which compiles a static graph first and a dynamic one after) gives the same numbers as a correct
one, so every AR suite passes on it; only the compile count tells. The compiled runner
(`parity.runners.make_runner("compiled")`, fullgraph, dynamic) is prepared on the first warm-up
shape of `cases/ar.toml` [recompiles]; each warm-up point must compile exactly its expected count
(the 0/1 specializations, with their reasons), and every lattice point after must compile
nothing. Counted: the target adapter's `forward` code object only (`parity.observe.compile_ledger`),
never all frames; a recompile-limit fallback to eager is a failing row, not a pass.

Rows: `case` = the shape (`batch=3,length=17`; warm-up points prefixed `warm-up`), `mode`
compiled, `site` the counted code object, gate `new_compiles` with the recompile reasons in the
detail, `compiles` (cumulative, info); then `graph_breaks` and `eager_fallback` (case `summary`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from parity.compare import AT_MOST, EXACTLY, count_rule
from parity.contract import requirement
from parity.observe.compile_ledger import CompileEvent, CompileLedger, code_label, code_of, short_reason
from parity.observe.dynamic import backend_text
from parity.runners import make_runner
from parity.suites.ar.support import CASES, ARModels, RecompileLattice
from parity.suites.conftest import require_graph_support
from parity.suites.recompile_rows import write_ledger_summary

pytestmark = [pytest.mark.parity_suite("recompiles"), pytest.mark.parity_compiles]

LATTICE: RecompileLattice = CASES["recompiles"]
COMPILE = requirement("compile_settings")  # make_runner("compiled")'s defaults, as docs/targets.md §2.2 states them


def shape_name(batch: int, length: int) -> str:
    return f"batch={batch},length={length}"


def token_ids(models: ARModels, batch: int, length: int, seed: int) -> torch.Tensor:
    """Seeded ids over both vocabularies (und and gen tokens, so the compiled blend routes both)."""
    generator = torch.Generator().manual_seed(seed)
    high = models.config.gen_vocab_start_index + models.config.gen_vocab_size
    return torch.randint(0, high, (batch, length), generator=generator).to(models.device)


class ForwardCompiles:
    """Compiles of one code object since the previous `take()`, with Dynamo's reasons."""

    def __init__(self, ledger: CompileLedger, code: Any) -> None:
        self.ledger, self.code = ledger, code
        self.total = self.events_seen = 0

    def take(self) -> tuple[int, str]:
        total = self.ledger.compiles(self.code)
        new, self.total = total - self.total, total
        events = [e for e in self.ledger.events if e.code is self.code and e.kind in ("compile", "recompile", "limit_hit")]
        fresh, self.events_seen = events[self.events_seen :], len(events)
        return new, describe(fresh)


def describe(events: list[CompileEvent]) -> str:
    if not events:
        return "no compile"
    parts = []
    for event in events:
        if event.kind == "compile":
            parts.append(f"first compile of {event.label}")
        elif event.kind == "limit_hit":
            parts.append(f"recompile limit hit for {event.label}: further shapes run eager")
        else:
            parts.append(f"recompile of {event.label}: " + "; ".join(short_reason(r) for r in event.reasons))
    return " || ".join(parts)


def test_no_forward_recompile_after_warm_up(ar_models: ARModels, report, settings) -> None:
    models = ar_models
    require_graph_support(models.target, "compiled")
    if models.size != "tiny":
        pytest.skip("compiled AR modes run on the tiny model (full-size compile time per shape is past the GPU lane's budget)")
    code = code_of(models.target.forward)
    site = code_label(code)
    report.mode, report.seed = "compiled", settings.seed
    seed = settings.seed
    with CompileLedger() as ledger:
        runner = make_runner(
            "compiled", device=models.device, capture_registry=models.target.capture, backend=LATTICE.backend, ledger=ledger
        )
        first = LATTICE.warmup[0]
        counter = ForwardCompiles(ledger, code)
        with runner.prepare(models.target.forward, (token_ids(models, first.batch, first.length, seed),), name="forward") as run:
            for i, warm in enumerate(LATTICE.warmup):
                if i:  # the first point compiled at prepare
                    run(token_ids(models, warm.batch, warm.length, seed + i))
                new, seen = counter.take()
                case = f"warm-up {shape_name(warm.batch, warm.length)}"
                report.verdict(
                    count_rule(
                        new,
                        warm.expected_compiles,
                        metric="new_compiles",
                        at=EXACTLY,
                        detail=f"warm-up: expected {warm.expected_compiles} ({warm.reason}); seen: {seen}; "
                        f"compiled {COMPILE.words}, backend {backend_text(LATTICE.backend, LATTICE.backend_reason)}; {COMPILE.cite}",
                    ),
                    case=case,
                    site=site,
                )
                report.info(case=case, site=site, metric="compiles", value=counter.total)
            for batch in LATTICE.batch_sizes:
                for length in LATTICE.lengths:
                    run(token_ids(models, batch, length, seed + 100 * batch + length))
                    new, seen = counter.take()
                    case = shape_name(batch, length)
                    report.verdict(
                        count_rule(new, 0, metric="new_compiles", at=AT_MOST, detail=f"after warm-up: {seen}"),
                        case=case,
                        site=site,
                    )
                    report.info(case=case, site=site, metric="compiles", value=counter.total)
    _summary(report, ledger, code, site)


def _summary(report: Any, ledger: CompileLedger, code: Any, site: str) -> None:
    write_ledger_summary(report, ledger, [code], site=site)

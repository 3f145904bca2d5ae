"""Recompiles: regional compile of the target's DiT, then a lattice of shapes that must not recompile.

The defects of vllm-project/vllm-omni#7455 this suite stands against:

* `_repeated_blocks` missing or empty: the runner logs "Regional compilation skipped", runs eager,
  and every parity test passes. Here `regional_modules_compiled` is a gate row (>= 1) and the
  warm-up counts of the block's `forward` are exact.
* The empty-text skip in the block (`if sequence_length == 0`): a guard on a backed size, so CFG's
  zero-length unconditional stream compiles one more graph when it first arrives. Here every
  lattice point after the warm-up must add zero compiles, with the recompile reasons in the row.
* An all-frames counter: library code compiles its own frames, so counting every frame passed
  with regional compile off. Here only `<block_class>.forward` is counted, per code object; the
  warm-up also compiles a control frame (the stage's decoder, compiled on its own) that must
  compile and must not be counted.
* Silent eager fallback past the recompile limit: `eager_fallback` is a gate row (0).

Rows: one per warm-up and lattice point, `case` = the shape
(`latent=32x64,text=0,cfg=on`), metrics `new_compiles` (gate) and `compiles` (info, cumulative),
recompile reasons in the detail; then `regional_modules_compiled`, `graph_breaks`,
`eager_fallback`, the control frame and the ledger's own rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from parity.compare import AT_LEAST, AT_MOST, EXACTLY, count_rule
from parity.observe.compile_ledger import CompileEvent, CompileLedger, code_label, code_of
from parity.observe.dynamic import backend_text, dynamic_compile
from parity.observe.regional import compile_repeated_blocks
from parity.suites.conftest import require_graph_support
from parity.suites.dit import support as dit_support
from parity.suites.dit.support import (
    CASE_FILE,
    RecompileLattice,
    block_class,
    block_codes,
    lattice_for,
    record_regional,
    short_reason,
    text_inputs,
)
from parity.suites.recompile_rows import write_ledger_summary

pytestmark = [pytest.mark.parity_suite("recompiles"), pytest.mark.parity_compiles]


@dataclasses.dataclass(frozen=True)
class Point:
    """One shape of the lattice: latent size, text length, CFG on or off."""

    height: int
    width: int
    text_len: int
    cfg: bool

    @property
    def name(self) -> str:
        return f"latent={self.height}x{self.width},text={self.text_len},cfg={'on' if self.cfg else 'off'}"


def lattice_points(lattice: RecompileLattice) -> list[Point]:
    return [Point(h, w, text_len, cfg) for h, w in lattice.sizes for text_len in lattice.text_lengths for cfg in lattice.cfg]


def run_point(adapter: Any, config: Any, lattice: RecompileLattice, point: Point, seed: int = 0) -> torch.Tensor:
    """The target's own pipeline at this shape: one sampler run (CFG on: the conditional call and
    the zero-length-text unconditional call, as the target issues them); returns the latents.
    `config` is the truth's DiTConfig (input sizes)."""
    states, mask = text_inputs(config, [point.text_len], lattice.text_seed + seed)
    guidance = lattice.guidance_scale if point.cfg else 1.0
    return adapter.sample(states, mask, point.height, point.width, lattice.steps, guidance, (0.0, 1.0), lattice.noise_seed + seed)


def control_target(adapter: Any) -> Any:
    """The stage's latent decoder (`adapter.decoder`, else the `decode` method): code outside
    the block region that an engine compiles on its own, as it compiles its VAE decode."""
    decoder = getattr(adapter, "decoder", None)
    return decoder if decoder is not None else adapter.decode


class BlockCompiles:
    """The block's compiles since the previous `take()`, with what Dynamo said about each."""

    def __init__(self, ledger: CompileLedger, codes: list[Any]) -> None:
        self.ledger, self.codes = ledger, codes
        self.total = self.events_seen = 0

    def take(self) -> tuple[int, str]:
        total = dit_support.count_block_compiles(self.ledger, self.codes)
        new, self.total = total - self.total, total
        events = [e for e in self.ledger.events if e.code in self.codes and e.kind in ("compile", "recompile")]
        fresh, self.events_seen = events[self.events_seen :], len(events)
        return new, describe_events(fresh)


def describe_events(events: list[CompileEvent]) -> str:
    if not events:
        return "no compile"
    parts = []
    for event in events:
        if event.kind == "compile":
            parts.append(f"first compile of {event.label}")
        else:
            parts.append(f"recompile of {event.label}: " + "; ".join(short_reason(r) for r in event.reasons))
    return " || ".join(parts)


def test_no_block_recompile_after_warm_up(dit_models, report, settings) -> None:
    adapter = dit_models.target
    require_graph_support(adapter, "compiled")
    lattice = lattice_for(dit_models.size)
    model = adapter.module
    block = block_class()
    codes = block_codes(model, block)
    site = f"{block}.forward"
    report.seed = settings.seed
    report.mode = "compiled"
    if not codes:
        report.verdict(
            count_rule(
                0,
                1,
                metric="block_modules",
                at=AT_LEAST,
                detail=f"no submodule of {type(model).__name__} is a {block} (cases/{CASE_FILE} [models] block_class)",
            ),
            case="dit-regional-compile",
        )
        return

    with CompileLedger() as ledger:
        regional = compile_repeated_blocks(model, dynamic=True, fullgraph=True, backend=lattice.backend, ledger=ledger)
        try:
            record_regional(report, regional, backend_text(lattice.backend, lattice.backend_reason))
            # Control frame: compiled on its own and run in the first warm-up point. It must
            # compile (so the counter's per-code discrimination is exercised) and never count.
            control_fn = control_target(adapter)
            control = dynamic_compile(control_fn, dynamic=True, fullgraph=True, backend=lattice.backend)
            counter = BlockCompiles(ledger, codes)
            for i, warm in enumerate(lattice.warmup):
                point = Point(warm.height, warm.width, warm.text_len, warm.cfg)
                latents = run_point(adapter, dit_models.config, lattice, point, seed=i)
                if i == 0:
                    control(latents)
                new, seen = counter.take()
                # "warm-up <shape>": a warm-up shape is visited again in the lattice, and each row
                # needs its own key (suite, case, target, mode, site, metric) for baselines
                report.verdict(
                    count_rule(
                        new,
                        warm.expected_compiles,
                        metric="new_compiles",
                        at=EXACTLY,
                        detail=f"warm-up: expected {warm.expected_compiles} ({warm.reason}); seen: {seen}",
                    ),
                    case=f"warm-up {point.name}",
                    site=site,
                )
                report.info(case=f"warm-up {point.name}", site=site, metric="compiles", value=counter.total)
            for point in lattice_points(lattice):
                run_point(adapter, dit_models.config, lattice, point)
                new, seen = counter.take()
                report.verdict(
                    count_rule(new, 0, metric="new_compiles", at=AT_MOST, detail=f"after warm-up: {seen}"),
                    case=point.name,
                    site=site,
                )
                report.info(case=point.name, site=site, metric="compiles", value=counter.total)
        finally:
            regional.restore()

    _summary_rows(report, ledger, codes, code_of(control_fn), site)


def _summary_rows(report: Any, ledger: CompileLedger, codes: list[Any], control_code: Any, site: str) -> None:
    control = count_rule(
        ledger.compiles(control_code),
        1,
        metric="control_frame_compiles",
        at=AT_LEAST,
        detail="a frame outside the block region (the decoder, compiled on its own) compiled and was not "
        f"counted against {site}: all frames compiled {ledger.compiles()}, block frames "
        f"{dit_support.count_block_compiles(ledger, codes)}",
    )
    write_ledger_summary(
        report, ledger, codes, site=site, calls_noun="block calls", extra=[(control, {"site": code_label(control_code)})]
    )

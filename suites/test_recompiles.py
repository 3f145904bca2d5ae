"""Recompiles: regional compile of the target's DiT, then a lattice of shapes that must not recompile.

The seed-002 defects (vllm-omni#7455) this suite stands against:

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

Rows (SUITES.md): one per warm-up and lattice point, `case` = the shape
(`latent=32x64,text=0,cfg=on`), metrics `new_compiles` (gate) and `compiles` (info, cumulative),
recompile reasons in the detail; then `regional_modules_compiled`, `graph_breaks`,
`eager_fallback`, the control frame and the ledger's own rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from parity.compare import FAIL, PASS
from parity.compile_watch import CompileEvent, CompileLedger, code_label
from parity.regional import compile_repeated_blocks
from suites.conftest import require_graph_support
from suites import dit_support
from suites.dit_support import (
    CASE_FILE,
    RecompileLattice,
    block_class,
    block_codes,
    dit_models,  # noqa: F401  (session fixture)
    lattice_for,
    short_reason,
    text_inputs,
)

pytestmark = pytest.mark.suite("recompiles")


def block_events(ledger: CompileLedger, codes: list[Any]) -> list[CompileEvent]:
    return [event for event in ledger.events if event.code in codes and event.kind in ("compile", "recompile")]


def point_name(height: int, width: int, text_len: int, cfg: bool) -> str:
    return f"latent={height}x{width},text={text_len},cfg={'on' if cfg else 'off'}"


def run_point(adapter: Any, lattice: RecompileLattice, height: int, width: int, text_len: int, cfg: bool, seed: int) -> torch.Tensor:
    """One sampler run of the target's pipeline at this shape (CFG on: conditional + empty-text call)."""
    states, mask = text_inputs(adapter.config, [text_len], lattice.text_seed + seed)
    guidance = lattice.guidance_scale if cfg else 1.0
    return adapter.sample(states, mask, height, width, lattice.steps, guidance, (0.0, 1.0), lattice.noise_seed + seed)


def describe_events(events: list[CompileEvent]) -> str:
    if not events:
        return "no compile"
    parts = []
    for event in events:
        if event.kind == "compile":
            parts.append(f"first compile of {event.label}")
        else:
            reasons = "; ".join(short_reason(r) for r in event.reasons)
            parts.append(f"recompile of {event.label}: {reasons}")
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
        report.record(
            case="regional-compile",
            metric="block_modules",
            value=0,
            threshold=1,
            verdict=FAIL,
            detail=f"no submodule of {type(model).__name__} is a {block} (cases/{CASE_FILE} [models] block_class)",
        )
        return

    with CompileLedger() as ledger:
        regional = compile_repeated_blocks(model, dynamic=True, fullgraph=True, backend=lattice.backend, ledger=ledger)
        try:
            (regional_row,) = regional.rows()
            report.record(
                case="regional-compile",
                metric="regional_modules_compiled",
                value=regional.count,
                threshold=1,
                verdict=regional_row["verdict"],
                detail=f"{regional_row['detail']}; fullgraph=True dynamic=True backend={lattice.backend} "
                f"({lattice.backend_reason})",
                better="higher",
            )
            # Control frame: compiled on its own, run once in the first warm-up point. It must
            # compile (so the counter's per-code discrimination is exercised) and never count.
            control = torch.compile(adapter.decoder, dynamic=True, fullgraph=True, backend=lattice.backend)
            control_code = type(adapter.decoder).forward.__code__

            seen = 0
            for i, point in enumerate(lattice.warmup):
                events_before = len(block_events(ledger, codes))
                latents = run_point(adapter, lattice, point.height, point.width, point.text_len, point.cfg, i)
                if i == 0:
                    control(latents)
                total = dit_support.count_block_compiles(ledger, codes)
                new = total - seen
                seen = total
                events = block_events(ledger, codes)[events_before:]
                case = point_name(point.height, point.width, point.text_len, point.cfg)
                report.record(
                    case=case,
                    site=site,
                    metric="new_compiles",
                    value=new,
                    threshold=point.expected_compiles,
                    verdict=PASS if new == point.expected_compiles else FAIL,
                    detail=f"warm-up: expected {point.expected_compiles} ({point.reason}); seen: {describe_events(events)}",
                    better="equal",
                )
                report.info(case=case, site=site, metric="compiles", value=total, detail="cumulative", better="lower")

            for h, w in lattice.sizes:
                for text_len in lattice.text_lengths:
                    for cfg in lattice.cfg:
                        events_before = len(block_events(ledger, codes))
                        run_point(adapter, lattice, h, w, text_len, cfg, 0)
                        total = dit_support.count_block_compiles(ledger, codes)
                        new = total - seen
                        seen = total
                        events = block_events(ledger, codes)[events_before:]
                        case = point_name(h, w, text_len, cfg)
                        report.record(
                            case=case,
                            site=site,
                            metric="new_compiles",
                            value=new,
                            threshold=0,
                            verdict=PASS if new == 0 else FAIL,
                            detail=f"after warm-up: {describe_events(events)}",
                        )
                        report.info(case=case, site=site, metric="compiles", value=total, detail="cumulative", better="lower")
        finally:
            regional.restore()

    _summary_rows(report, ledger, codes, control_code, site)


def _summary_rows(report, ledger: CompileLedger, codes: list[Any], control_code: Any, site: str) -> None:
    report.case = "summary"
    breaks = ledger.graph_breaks()
    report.record(
        site=site,
        metric="graph_breaks",
        value=sum(breaks.values()),
        threshold=0,
        verdict=PASS if not breaks else FAIL,
        detail="; ".join(f"{n}x {reason}" for reason, n in breaks.items()) or "none (fullgraph=True)",
    )
    fallbacks = [fb for fb in ledger.eager_fallbacks() if fb.code in codes]
    eager_calls = sum(fb.calls_since or 0 for fb in fallbacks)
    calls = sum(ledger.calls(code) for code in codes)
    report.record(
        site=site,
        metric="eager_fallback",
        value=eager_calls,
        threshold=0,
        verdict=PASS if not fallbacks else FAIL,
        detail=(
            "; ".join(f"{fb.label}: {fb.limit_type} hit at call {fb.hit_at_call}, {fb.calls_since} calls since" for fb in fallbacks)
            if fallbacks
            else f"no recompile limit hit; {calls} block calls went through the compiled forward"
        ),
    )
    control_compiles = ledger.compiles(control_code)
    report.record(
        site=code_label(control_code),
        metric="control_frame_compiles",
        value=control_compiles,
        threshold=1,
        verdict=PASS if control_compiles >= 1 else FAIL,
        detail="a frame outside the block region (the decoder, compiled on its own) compiled and was not "
        f"counted against {site}: all frames compiled {ledger.compiles()}, block frames "
        f"{dit_support.count_block_compiles(ledger, codes)}",
        better="higher",
    )
    for row in ledger.rows():  # every code object Dynamo touched, with its reasons (counts: info)
        if row["metric"] != "graph_breaks":  # already the gate row above
            report.info(site=site, **{**row, "verdict": row["verdict"] or PASS})

"""Localising an AR divergence to a stage: re-run the failing case with stage taps on all three sides.

The target runs in the mode that failed (its stage map, `parity.localise`), the reference in its
dtype and the fp64 golden eagerly (the reference adapter's own map); `parity.localise.chain`
judges every stage with the suites' noise-floor rule and blames the first that diverges while its
inputs are within bound (docs/localise.md). A compiled mode is traced afresh with the taps
(`fresh_frame`); where its graph still runs no tap the eager run recorded, the stages are judged
from the eager target and the compile-only bisection answers for the compiler (docs/localise.md §4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from parity.localise.bisect import bisect_compiled
from parity.localise.chain import Chain, Side, build_chain
from parity.localise.observe import Recorded, Resolved, fresh_frame, observe_eager, resolve, stage_values, unobserved_sites
from parity.localise.repro import StageSource, write_repro
from parity.localise.rows import write_bisection, write_chain
from parity.localise.vocabulary import vocabulary
from parity.runners import make_runner
from parity.suites.ar.support import COMPILED_MODES, ARModels

VOCABULARY = vocabulary("ar")


def _layers(models: ARModels) -> int:
    return int(models.config.num_hidden_layers)


def stage_maps(models: ARModels) -> tuple[Resolved, Resolved, Resolved]:
    """The target's, the reference's and the golden's maps bound to their modules."""
    layers = _layers(models)
    target_map = getattr(models.target, "stage_map", None) or {}
    return (
        resolve(getattr(models.target, "module", None), target_map, VOCABULARY, layers),
        resolve(models.reference.module, models.reference.stage_map, VOCABULARY, layers),
        resolve(models.golden.module, models.golden.stage_map, VOCABULARY, layers),
    )


def observe_target(
    models: ARModels, resolved: Resolved, mode: str, call: Any, args: tuple[Any, ...]
) -> dict[str, Recorded | None]:
    """The target's stage values of `call(*args)` in `mode` (function taps only in eager; a
    compiled mode compiles `call` behind a fresh code object, so the taps are traced)."""
    root = models.target.module
    if mode == "eager":
        return observe_eager(root, resolved, lambda: call(*args))[1]
    if mode in COMPILED_MODES:
        call = fresh_frame(call)
    runner = make_runner(mode, device=models.device, capture_registry=models.target.capture)
    with runner.prepare(call, args, dummy="zeros", taps=resolved.modules(root), name="localise") as run, torch.no_grad():
        result = run(*args)
    return stage_values(resolved, result.taps, {})


def localise_forward(
    models: ARModels, ids: torch.Tensor, mode: str, *, compared: str, target_values: dict[str, Recorded | None] | None = None
) -> Chain:
    """The stage chain of one full forward over `ids` (a numerics case); `target_values`: the
    target's stage values when already observed."""
    target_map, reference_map, golden_map = stage_maps(models)
    if target_values is None:
        target_values = observe_target(models, target_map, mode, models.target.forward, (ids,))
    _, reference_values = observe_eager(models.reference.module, reference_map, lambda: models.reference.forward(ids))
    _, golden_values = observe_eager(models.golden.module, golden_map, lambda: models.golden.forward(ids))
    gen = ids >= models.start
    return build_chain(
        VOCABULARY,
        target_map=target_map,
        reference_map=reference_map,
        target=Side(target_values, gen),
        reference=Side(reference_values, gen),
        golden=Side(golden_values, gen),
        compared=compared,
    )


def _observe_decode(models: ARModels, resolved: Resolved, mode: str, prompt: torch.Tensor, fed: torch.Tensor) -> dict[str, Any]:
    """The target's stage values of its last call when prefilled with `prompt` and fed the tokens
    `fed` one decode step each (none: the prefill is the observed call), in `mode`: eager calls, or
    the suite's decode graphs captured with the stage taps and replayed (docs/localise.md §3)."""
    from parity.suites.ar.decode import DecodeGraphs  # the decode suite's own graphs, taps included

    target, root = models.target, models.target.module
    batch, length = prompt.shape
    target.allocate_decode_state(batch, length + fed.shape[1] + 1)
    positions = [torch.full((batch,), length + i, dtype=torch.long, device=prompt.device) for i in range(fed.shape[1])]
    if fed.shape[1] == 0:
        return observe_eager(root, resolved, lambda: target.prefill(prompt))[1]
    if mode == "eager":
        target.prefill(prompt)
        for i in range(fed.shape[1] - 1):
            target.decode_step(fed[:, i : i + 1], positions[i])
        return observe_eager(root, resolved, lambda: target.decode_step(fed[:, -1:], positions[-1]))[1]
    with DecodeGraphs(models, mode, batch, taps=resolved.modules(root)) as graphs, torch.no_grad():
        target.prefill(prompt)
        result = None
        for i in range(fed.shape[1]):
            result = graphs.run(fed[:, i : i + 1], positions[i])
    return stage_values(resolved, result.taps, {})


def localise_decode(
    models: ARModels, prompt: torch.Tensor, tokens: torch.Tensor, step: int, mode: str, *, compared: str
) -> Chain:
    """The stage chain of teacher-forced decode step `step`: the call that produced its logits (the
    prefill for step 0, else the decode step fed `tokens[:, step - 1]`) against the last position of
    the reference's and the golden's full forward over the same context."""
    target_map, reference_map, golden_map = stage_maps(models)
    fed = tokens[:, :step]
    context = torch.cat([prompt, fed], dim=1)
    target_values = _observe_decode(models, target_map, mode, prompt, fed)
    _, reference_values = observe_eager(models.reference.module, reference_map, lambda: models.reference.forward(context))
    _, golden_values = observe_eager(models.golden.module, golden_map, lambda: models.golden.forward(context))
    gen = context >= models.start
    keep = torch.ones_like(gen) if step == 0 else torch.zeros_like(gen)
    keep[:, -1] = True
    target_gen = gen if step == 0 else gen[:, -1:]
    return build_chain(
        VOCABULARY,
        target_map=target_map,
        reference_map=reference_map,
        target=Side(target_values, target_gen),
        reference=Side(reference_values, gen, keep),
        golden=Side(golden_values, gen, keep),
        compared=compared,
    )


def explain_forward(models: ARModels, ids: torch.Tensor, mode: str, report: Any, run_dir: Path, *, case: str) -> Chain:
    """A failing numerics case: its stage chain in the failing mode, the blamed stage's repro, the rows."""
    compared = f"{case} {mode}: every token of ids {tuple(ids.shape)}, {models.dtype} vs the fp64 golden"
    target_map, reference_map, _ = stage_maps(models)
    eager: Chain | None = None
    if mode in COMPILED_MODES:
        values = observe_target(models, target_map, mode, models.target.forward, (ids,))
        eager_values = observe_target(models, target_map, "eager", models.target.forward, (ids,))
        eager = localise_forward(models, ids, "eager", compared=f"{case} eager", target_values=eager_values)
        silent = unobserved_sites(values, eager_values)
        if silent:  # the compiled graph ran no tap there: judge the eager target's stages (docs/localise.md §4)
            shown = ", ".join(silent[:4]) + (f" and {len(silent) - 4} more" if len(silent) > 4 else "")
            compared += f"; stages from the eager target: the compiled graph ran no tap at {shown}"
            values = eager_values
        chain = localise_forward(models, ids, mode, compared=compared, target_values=values)
    else:
        chain = localise_forward(models, ids, mode, compared=compared)
    repro = write_repro(
        run_dir,
        chain,
        case=case,
        mode=mode,
        target=StageSource(models.target.module, target_map, lambda: models.target.forward(ids)),
        reference=StageSource(models.reference.module, reference_map, lambda: models.reference.forward(ids)),
    )
    write_chain(report, chain, case=case, mode=mode, repro=repro)
    if eager is not None:
        explain_compile_only(models, ids, report, case=case, mode=mode, eager=eager)
    return chain


def explain_compile_only(
    models: ARModels, ids: torch.Tensor, report: Any, *, case: str, mode: str, eager: Chain | None = None
) -> None:
    """A compiled case whose eager target matches the reference: bisect the compiled region to
    the smallest piece whose compiled output differs from its eager run (docs/localise.md §4).
    `eager`: the case's eager chain, when already made."""
    if eager is None:
        eager = localise_forward(models, ids, "eager", compared=f"{case} eager")
    if eager.blamed is not None:
        return  # the eager target diverges too: the chain above is the answer, not the compiler
    bisection = bisect_compiled(models.target.module, lambda: models.target.forward(ids))
    write_bisection(report, bisection, case=case, mode=mode)


def explain_decode(
    models: ARModels, prompt: torch.Tensor, tokens: torch.Tensor, step: int, mode: str, report: Any, run_dir: Path, *, case: str
) -> Chain:
    """A failing teacher-forced decode case: the stage chain of its first step above the noise floor."""
    what = (
        "the prefill"
        if step == 0
        else f"the decode step fed token {int(tokens[0, step - 1])} at position {prompt.shape[1] + step - 1}"
    )
    compared = f"{case} {mode}: step {step} ({what}) against the last position of the reference's forward over the same context"
    chain = localise_decode(models, prompt, tokens, step, mode, compared=compared)
    target_map, reference_map, _ = stage_maps(models)
    context = torch.cat([prompt, tokens[:, :step]], dim=1)
    fed = tokens[:, :step]

    def target_step() -> Any:  # eager, for the repro's capture
        _observe_decode(models, Resolved({}, (), target_map.layers), "eager", prompt, fed)

    repro = write_repro(
        run_dir,
        chain,
        case=case,
        mode=mode,
        target=StageSource(models.target.module, target_map, target_step),
        reference=StageSource(models.reference.module, reference_map, lambda: models.reference.forward(context)),
    )
    write_chain(report, chain, case=case, mode=mode, repro=repro)
    return chain

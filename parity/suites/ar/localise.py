"""Localising an AR divergence to a stage: re-run the failing case with stage taps on all three sides.

The target runs in the mode that failed (its stage map, `parity.localise`), the reference in its
dtype and the fp64 golden eagerly (the reference adapter's own map); `parity.localise.chain`
judges every stage with the suites' noise-floor rule and blames the first that diverges while its
inputs are within bound (docs/localise.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from parity.localise.chain import Chain, Side, build_chain
from parity.localise.observe import Resolved, observe_eager, resolve, stage_values
from parity.localise.repro import StageSource, write_repro
from parity.localise.rows import write_chain
from parity.localise.vocabulary import vocabulary
from parity.runners import make_runner
from parity.suites.ar.support import ARModels

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


def observe_target(models: ARModels, resolved: Resolved, mode: str, call: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    """The target's stage values of `call(*args)` in `mode` (function taps only in eager)."""
    root = models.target.module
    if mode == "eager":
        return observe_eager(root, resolved, lambda: call(*args))[1]
    runner = make_runner(mode, device=models.device, capture_registry=models.target.capture)
    with runner.prepare(call, args, dummy="zeros", taps=resolved.modules(root), name="localise") as run, torch.no_grad():
        result = run(*args)
    return stage_values(resolved, result.taps, {})


def localise_forward(models: ARModels, ids: torch.Tensor, mode: str, *, compared: str) -> Chain:
    """The stage chain of one full forward over `ids` (a numerics case)."""
    target_map, reference_map, golden_map = stage_maps(models)
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


def localise_decode_step(
    models: ARModels, context: torch.Tensor, step: int, mode: str, *, compared: str, step_fn: Any = None
) -> Chain:
    """The stage chain of decode step `step` of a teacher-forced decode: the target is prefilled
    with `context[:, :L]` and fed `context` token by token up to the step; its last step's stages
    are compared with the last position of the reference's full forward over the same context."""
    target_map, reference_map, golden_map = stage_maps(models)
    batch, total = context.shape
    prompt_len = total - step - 1
    target = models.target
    target.allocate_decode_state(batch, total + 1)
    target.prefill(context[:, :prompt_len])
    step_call = step_fn or target.decode_step
    for position in range(prompt_len, total - 1):
        step_call(context[:, position : position + 1], torch.full((batch,), position, device=context.device))
    last = total - 1
    args = (context[:, last:], torch.full((batch,), last, device=context.device))
    if mode == "eager" or step_fn is None:
        _, target_values = observe_eager(target.module, target_map, lambda: step_call(*args))
    else:
        raise ValueError("graph-mode decode localisation takes the suite's prepared step (step_fn) in eager observation only")
    _, reference_values = observe_eager(models.reference.module, reference_map, lambda: models.reference.forward(context))
    _, golden_values = observe_eager(models.golden.module, golden_map, lambda: models.golden.forward(context))
    gen = context >= models.start
    keep = torch.zeros_like(gen)
    keep[:, -1] = True
    return build_chain(
        VOCABULARY,
        target_map=target_map,
        reference_map=reference_map,
        target=Side(target_values, gen[:, -1:]),
        reference=Side(reference_values, gen, keep),
        golden=Side(golden_values, gen, keep),
        compared=compared,
    )


def explain_forward(models: ARModels, ids: torch.Tensor, mode: str, report: Any, run_dir: Path, *, case: str) -> Chain:
    """A failing numerics case: its stage chain in the failing mode, the blamed stage's repro, the rows."""
    compared = f"{case} {mode}: every token of ids {tuple(ids.shape)}, {models.dtype} vs the fp64 golden"
    chain = localise_forward(models, ids, mode, compared=compared)
    target_map, reference_map, _ = stage_maps(models)
    repro = write_repro(
        run_dir,
        chain,
        case=case,
        mode=mode,
        target=StageSource(models.target.module, target_map, lambda: models.target.forward(ids)),
        reference=StageSource(models.reference.module, reference_map, lambda: models.reference.forward(ids)),
    )
    write_chain(report, chain, case=case, mode=mode, repro=repro)
    return chain

"""Localising a DiT divergence to a stage: re-run the failing case with stage taps on all three sides.

The target runs in the mode that failed (its adapter's `stage_map`), the reference in its dtype
and the fp64 golden eagerly (the reference adapter's own map); `parity.localise.chain` judges
every stage with the suites' noise-floor rule and blames the first that diverges while its
inputs are within bound (docs/localise.md).

A velocity case compares the model's stages: the embedders, the RoPE table, every block of the
context refiner, the noise refiner and the main stack, the final layer. Only the tokens a case
means are compared (`token_keeps`): a padded text slot carries nothing, and the two
implementations place the padding differently in the joint sequence (the adapters' `joint_layout`).
An image case compares the sampler around the model (`IMAGE_STAGES`): the schedule, each step's
guidance scale, the first step's velocities, the latents after every step, the decoder's float RGB.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from parity.localise.bisect import bisect_compiled
from parity.localise.chain import Chain, Side, build_chain
from parity.localise.families.dit import IMAGE_STAGES, JOINT_LAYOUTS, block_counts
from parity.localise.observe import Recorded, Resolved, observe_eager, resolve
from parity.localise.repro import StageSource, write_repro
from parity.localise.rows import write_bisection, write_chain
from parity.localise.vocabulary import vocabulary
from parity.observe.compile_ledger import reset_compile_state
from parity.observe.regional import compile_repeated_blocks
from parity.suites.dit.support import COMPARE_BACKEND, DiTModels, forward

VOCABULARY = vocabulary("dit")


def _only(stage_map: Any, keys: tuple[str, ...] | None) -> Any:
    if keys is None or not isinstance(stage_map, Mapping):
        return stage_map
    return {key: value for key, value in stage_map.items() if key in keys}


def stage_maps(models: DiTModels, only: tuple[str, ...] | None = None) -> tuple[Resolved, Resolved, Resolved]:
    """The target's, the reference's and the golden's maps bound to their modules (`only`: those stages)."""
    layers = block_counts(models.config)
    target_map = _only(getattr(models.target, "stage_map", None) or {}, only)
    return (
        resolve(getattr(models.target, "module", None), target_map, VOCABULARY, layers),
        resolve(models.reference.module, _only(models.reference.stage_map, only), VOCABULARY, layers),
        resolve(models.golden.module, _only(models.golden.stage_map, only), VOCABULARY, layers),
    )


@contextlib.contextmanager
def _in_mode(adapter: Any, mode: str) -> Iterator[None]:
    """Inside: the adapter's model as the failing mode ran it (compiled: its repeated blocks
    regionally compiled with the suites' backend; the taps are hooks, which Dynamo traces).

    Compiled from an empty Dynamo cache, and the cache emptied again after: Dynamo does not guard
    a block's compiled forward on its submodules' hooks, so the gate's compile (no taps) would be
    reused and record nothing inside the blocks, and the tapped graph would outlive the taps."""
    if mode == "eager":
        yield
        return
    if mode != "compiled":
        raise ValueError(f"DiT localisation runs the eager and compiled modes, not {mode!r}")
    reset_compile_state()
    regional = compile_repeated_blocks(adapter.module, dynamic=True, fullgraph=True, backend=COMPARE_BACKEND)
    try:
        yield
    finally:
        regional.restore()
        reset_compile_state()


def observe(adapter: Any, resolved: Resolved, mode: str, run: Callable[[], Any]) -> dict[str, Recorded | None]:
    """`adapter`'s stage values of `run()` in `mode`."""
    with _in_mode(adapter, mode):
        return observe_eager(getattr(adapter, "module", None), resolved, run)[1]


def token_keeps(
    values: Mapping[str, Recorded | None], text_mask: torch.Tensor, image_tokens: int, layout: str | None
) -> dict[str, torch.Tensor]:
    """Per site, the token rows a velocity case compares: the real text tokens of the caption and
    the context refiner, every real token of the joint sequence (main stack, RoPE table) and the
    image tokens of the head. `layout` None (a target that does not say how it lays out the joint
    sequence): only the tokens every layout puts in the same place, the real text and the image
    of samples whose text is not padded."""
    text_mask = text_mask.to(torch.bool).cpu()
    batch, text_len = text_mask.shape
    cap = text_mask.sum(dim=1)[:, None]
    unpadded = (cap == text_len).expand(batch, 1)
    keeps: dict[str, torch.Tensor] = {}
    for site, recorded in values.items():
        if recorded is None or recorded.value.dim() < 3 or recorded.value.shape[0] != batch:
            continue  # a per-sample stage (adaLN, temb) or a sampler stage: every row
        tokens = int(recorded.value.shape[1])
        group = site.split(".", 1)[0]
        position = torch.arange(tokens)[None, :]
        if group in ("caption_embed", "context_refiner") and tokens == text_len:
            keeps[site] = text_mask
        elif group in ("layers", "rope", "norm_out") and tokens != image_tokens:  # else the image tokens alone
            if layout == "text_slots":
                image = position >= text_len
            elif layout == "packed":
                image = (position >= cap) & (position < cap + image_tokens)
            else:
                image = unpadded & (position >= text_len) & (position < text_len + image_tokens)
            keeps[site] = image if group == "norm_out" else (position < cap) | image
    return keeps


def localise_forward(models: DiTModels, inputs: tuple[torch.Tensor, ...], mode: str, *, compared: str) -> Chain:
    """The stage chain of one forward over `inputs` (latents, timestep, text states, text mask)."""
    target_map, reference_map, golden_map = stage_maps(models)
    target_values = observe(models.target, target_map, mode, lambda: forward(models.target, inputs))
    reference_values = observe(models.reference, reference_map, "eager", lambda: forward(models.reference, inputs))
    golden_values = observe(models.golden, golden_map, "eager", lambda: forward(models.golden, inputs))
    latents, text_mask = inputs[0], inputs[3]
    patch = int(models.config.patch_size)
    image_tokens = (latents.shape[-2] // patch) * (latents.shape[-1] // patch)
    layout = getattr(models.target, "joint_layout", None)
    full = layout in JOINT_LAYOUTS  # else only the tokens every layout places alike, on all sides
    reference_layout = models.reference.joint_layout if full else None
    return build_chain(
        VOCABULARY,
        target_map=target_map,
        reference_map=reference_map,
        target=Side(target_values, keep=token_keeps(target_values, text_mask, image_tokens, layout if full else None)),
        reference=Side(reference_values, keep=token_keeps(reference_values, text_mask, image_tokens, reference_layout)),
        golden=Side(golden_values, keep=token_keeps(golden_values, text_mask, image_tokens, reference_layout)),
        compared=compared,
    )


def _first_step(values: dict[str, Recorded | None], rows: int | None) -> dict[str, Recorded | None]:
    """`values` with the velocity cut to the model calls of the first step (`rows` rows)."""
    velocity = values.get("velocity")
    if rows is None or velocity is None:
        return values
    return {**values, "velocity": Recorded(velocity.value[:rows], velocity.where)}


def _first_step_rows(reference: Mapping[str, Recorded | None]) -> int | None:
    """How many velocity rows the first step computes: the batch, twice under CFG (conditional,
    then unconditional: the reference's doubled batch and the serving way's two calls alike)."""
    guidance, latents = reference.get("guidance"), reference.get("latents")
    if guidance is None or latents is None or not guidance.value.numel():
        return None
    batch = latents.value.shape[0] // guidance.value.numel()
    return batch * (2 if float(guidance.value.reshape(-1)[0]) > 1.0 else 1)


def localise_image(models: DiTModels, generate: Callable[[Any], Any], mode: str, *, compared: str) -> Chain:
    """The stage chain of one image case: `generate(adapter)` runs an adapter's sampling loop and decoder."""
    target_map, reference_map, golden_map = stage_maps(models, only=IMAGE_STAGES)
    target_values = observe(models.target, target_map, mode, lambda: generate(models.target))
    reference_values = observe(models.reference, reference_map, "eager", lambda: generate(models.reference))
    golden_values = observe(models.golden, golden_map, "eager", lambda: generate(models.golden))
    rows = _first_step_rows(reference_values)
    return build_chain(
        VOCABULARY,
        target_map=target_map,
        reference_map=reference_map,
        target=Side(_first_step(target_values, rows)),
        reference=Side(_first_step(reference_values, rows)),
        golden=Side(_first_step(golden_values, rows)),
        compared=compared,
    )


def explain_forward(
    models: DiTModels, inputs: tuple[torch.Tensor, ...], mode: str, report: Any, run_dir: Path, *, case: str
) -> Chain:
    """A failing velocity or blocks case: its stage chain in the failing mode, the blamed stage's repro, the rows."""
    shape = tuple(inputs[0].shape)
    compared = (
        f"{case} {mode}: one forward on latents {shape}, text {tuple(inputs[2].shape[:2])}, {models.dtype} vs the fp64 golden"
    )
    chain = localise_forward(models, inputs, mode, compared=compared)
    target_map, reference_map, _ = stage_maps(models)
    repro = write_repro(
        run_dir,
        chain,
        case=case,
        mode=mode,
        target=StageSource(models.target.module, target_map, lambda: forward(models.target, inputs)),
        reference=StageSource(models.reference.module, reference_map, lambda: forward(models.reference, inputs)),
    )
    write_chain(report, chain, case=case, mode=mode, repro=repro)
    return chain


def explain_image(
    models: DiTModels, generate: Callable[[Any], Any], mode: str, report: Any, run_dir: Path, *, case: str
) -> Chain:
    """A failing image case: its sampler's stage chain in the failing mode, the blamed stage's repro, the rows."""
    compared = f"{case} {mode}: the sampling loop and the decoder, {models.dtype} vs the fp64 golden"
    chain = localise_image(models, generate, mode, compared=compared)
    repro = ""
    if chain.blamed is not None and chain.blamed.site == "velocity":
        repro = "(no repro: the velocity is the whole model; a velocity case localises a model defect inside it)"
    elif chain.blamed is not None:
        target_map, reference_map, _ = stage_maps(models, only=IMAGE_STAGES)
        repro = write_repro(
            run_dir,
            chain,
            case=case,
            mode=mode,
            target=StageSource(models.target.module, target_map, lambda: generate(models.target)),
            reference=StageSource(models.reference.module, reference_map, lambda: generate(models.reference)),
        )
    write_chain(report, chain, case=case, mode=mode, repro=repro)
    return chain


def explain_compile_only(models: DiTModels, inputs: tuple[torch.Tensor, ...], report: Any, *, case: str) -> None:
    """A compiled case that differs from the eager target: the smallest compiled piece whose output
    differs from the same piece run eagerly (docs/localise.md §4), as a row under the case."""
    bisection = bisect_compiled(models.target.module, lambda: forward(models.target, inputs))
    write_bisection(report, bisection, case=case, mode="compiled")

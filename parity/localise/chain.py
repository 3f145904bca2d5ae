"""The stage chain of one case: every stage's error against the fp64 golden, and the stage to blame.

Each side's stage values are aligned to rows of the reference's feature width (`align`): the
tokens the case compares (`Side.keep`: all of a prefill, the last position of a decode step) and,
for an expert's stages, only that expert's tokens. A float stage is judged by the golden
noise-floor rule of the suites (`parity.compare.golden_noise_rule`): the target may be at most the
multiplier times as far from the fp64 golden as the reference in its own dtype is, at that stage,
in this run. An integer or bool stage (top-k ids, a group mask) must equal the reference's.

The stage blamed is the first in execution order whose output is out of bound while every stage
it reads is within bound: a stage that only inherits error is not blamed (docs/localise.md §3).
A stage the target does not declare is "not observable"; the inputs of a stage then resolve to
the nearest observable stages they come from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from parity.compare import golden_noise_rule
from parity.localise.observe import Recorded, Resolved
from parity.localise.stages import Stage, Vocabulary

PASS, FAIL = "within", "diverged"
NOT_OBSERVABLE, NOT_OBSERVED, NOT_COMPARABLE = "not_observable", "not_observed", "not_comparable"


@dataclass(frozen=True)
class Side:
    """What one side recorded, and which of its tokens the case compares."""

    values: Mapping[str, Recorded | None]
    gen_mask: torch.Tensor | None = None  # [B, L] bool over the side's tokens (AR: which tokens are gen)
    # [B, L] bool: the tokens compared (None: all); per site where the token rows differ from
    # stage to stage (a DiT's text, image and joint sequences; a site not in the mapping: all)
    keep: torch.Tensor | Mapping[str, torch.Tensor | None] | None = None
    # Named row sets (bool over the side's rows) a stage's `rows` may name, the rows it covers
    # (routing: "real", the rows before the valid-row count, the only ones a reference selects for)
    row_sets: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def keep_for(self, site: str) -> torch.Tensor | None:
        return self.keep.get(site) if isinstance(self.keep, Mapping) else self.keep


@dataclass(frozen=True)
class StageError:
    site: str
    stage: str
    layer: int | None
    status: str  # PASS, FAIL or one of the NOT_* reasons
    value: float | None = None  # RMSE vs the golden (mismatching entries for an exact stage)
    bound: float | None = None
    detail: str = ""
    inputs: tuple[str, ...] = ()  # the observable sites its inputs resolve to

    @property
    def judged(self) -> bool:
        return self.status in (PASS, FAIL)


@dataclass
class Chain:
    """Every stage of one case in execution order, and the one blamed (None: no stage diverged)."""

    family: str
    compared: str  # what was compared: the case, the mode, the rows and positions
    stages: list[StageError] = field(default_factory=list)
    blamed: StageError | None = None
    widths: dict[str, int] = field(default_factory=dict)  # the reference's feature width per site (a fused split's parts)

    def stage(self, site: str) -> StageError | None:
        return next((s for s in self.stages if s.site == site), None)

    def summary(self) -> str:
        if self.blamed is None:
            return f"no stage diverged beyond its bound ({self.compared})"
        b = self.blamed
        inputs = ", ".join(f"{s} {self._value_text(s)}" for s in b.inputs)
        why = f"while its inputs were within bound ({inputs})" if inputs else "with no observable input before it"
        hidden = self.unobserved_between(b.site)
        if hidden:
            why += f"; {', '.join(hidden)} between them not observable (the defect may sit there)"
        return f"first diverging stage {b.site} ({b.detail or b.stage}): {self._value_text(b.site)} {why}; {self.compared}"

    def unobserved_between(self, site: str) -> list[str]:
        """The stages between `site` and its observable inputs that could not be judged."""
        out: list[str] = []
        found = self.stage(site)
        frontier = list(found.inputs) if found else []
        while frontier:
            name = frontier.pop(0)
            stage = self.stage(name)
            if stage is None or stage.judged or name in out:
                continue
            out.append(name)
            frontier += list(stage.inputs)
        return out

    def _value_text(self, site: str) -> str:
        s = self.stage(site)
        if s is None or s.value is None:
            return "?"
        return f"{s.value:.3g} (bound {s.bound:.3g})" if s.bound is not None else f"{s.value:.3g}"


def _width(value: torch.Tensor) -> int:
    return int(value.shape[-1]) if value.dim() else 1


def _rows(value: torch.Tensor, width: int) -> torch.Tensor | None:
    if value.numel() % width:
        return None
    return value.reshape(-1, width)


def _covered(side: Side, stage: Stage) -> torch.Tensor | None:
    """Bool over the side's token rows: the ones this stage covers (its expert's, a named row
    set's); None: every row."""
    if stage.rows in side.row_sets:
        return side.row_sets[stage.rows].reshape(-1).bool()
    if side.gen_mask is not None and stage.rows in ("und", "gen"):
        gen = side.gen_mask.reshape(-1)
        return gen if stage.rows == "gen" else ~gen
    return None


def _subset(side: Side, stage: Stage, site: str = "") -> torch.Tensor | None:
    """Bool over the side's token rows: the ones this stage covers (its expert's) and the case keeps."""
    rows = _covered(side, stage)
    keep = side.keep_for(site)
    if keep is not None:
        keep = keep.reshape(-1)
        rows = keep if rows is None else rows & keep
    return rows


def align(value: torch.Tensor, side: Side, stage: Stage, width: int, site: str = "") -> torch.Tensor | str:
    """`value` as `[rows compared, width]`, or the reason it cannot be."""
    table = _rows(value, width)
    if table is None:
        return f"{tuple(value.shape)} does not split into rows of the reference's width {width}"
    rows = _subset(side, stage, site)
    if rows is None:
        return table
    covered = _covered(side, stage)
    covered = torch.ones_like(rows) if covered is None else covered
    if table.shape[0] == rows.numel():  # every token: select the compared ones
        return table[rows.to(table.device)]
    if table.shape[0] == int(covered.sum()):  # only the tokens the stage covers (an expert's gathered rows, a router's real rows)
        return table[rows[covered].to(table.device)]
    return f"{table.shape[0]} rows where the case has {rows.numel()} tokens ({int(covered.sum())} {stage.rows})"


def _split(value: torch.Tensor, parts: tuple[str, ...], part: str, widths: Mapping[str, int]) -> torch.Tensor | str:
    unknown = [p for p in parts if widths.get(p) is None]
    if unknown:
        return f"the reference has no width for {unknown}"
    sizes = [widths[p] for p in parts]
    if value.shape[-1] != sum(sizes):
        return f"fused width {value.shape[-1]} is not the reference's {' + '.join(map(str, sizes))}"
    return value.split(sizes, dim=-1)[parts.index(part)]


def _compare(
    stage: Stage, golden: torch.Tensor, reference: torch.Tensor, target: torch.Tensor, site: str
) -> tuple[str, float, float, str]:
    if not golden.is_floating_point():
        mismatches = int((target.to(golden.device, golden.dtype) != golden).sum())
        return (PASS if mismatches == 0 else FAIL), float(mismatches), 0.0, "entries differing from the reference (exact stage)"
    target = target.to(golden.device)
    if target.dtype != reference.dtype and target.is_floating_point():
        target = target.to(reference.dtype)
    finite = torch.isfinite(golden)
    if not bool(finite.all()):  # the -inf keys of non-candidates, σ of a NaN logit: the target repeats them or is wrong
        reference, target = reference.to(golden.device), target.to(golden.device)
        same = (target.to(golden.dtype) == golden) | (torch.isnan(target) & torch.isnan(golden))
        differing = int((~finite & ~same).sum())
        if differing:
            return FAIL, float(differing), 0.0, "non-finite entries of the golden (inf, NaN) the target does not repeat"
        golden, reference, target = golden[finite], reference[finite], target[finite]
        if golden.numel() == 0:
            return PASS, 0.0, 0.0, ""
    verdict, _ = golden_noise_rule(golden.double(), reference, target, name=site)
    assert verdict.threshold is not None  # the noise-floor rule always states its bound
    return (PASS if verdict.ok else FAIL), float(verdict.value), float(verdict.threshold), ""


def build_chain(
    vocabulary: Vocabulary,
    *,
    target_map: Resolved,
    reference_map: Resolved,
    target: Side,
    reference: Side,
    golden: Side,
    compared: str,
) -> Chain:
    """Judge every stage the reference has, in execution order, and blame the first divergence."""
    chain = Chain(vocabulary.family, compared)
    layers = reference_map.layers
    widths: dict[str, int] = {}
    for site, stage, layer, blocks, _ in vocabulary.sites(layers):
        ref_value, gold_value = _value(reference, site, widths), _value(golden, site, widths)
        if site not in reference_map.sites or not isinstance(ref_value, torch.Tensor) or not isinstance(gold_value, torch.Tensor):
            continue  # the reference has no such stage here (a layer without the gen expert)
        widths[site] = _width(ref_value)
        if ref_value.numel() == 0 and gold_value.numel() == 0:
            continue  # the reference computes it on no token (a DiT's context refiner on empty text): nothing to compare
        inputs = tuple(i for i in vocabulary.input_sites(stage, layer, layers, blocks))
        if site not in target_map.sites:
            chain.stages.append(
                StageError(
                    site, stage.name, layer, NOT_OBSERVABLE, detail="the target's stage_map does not declare it", inputs=inputs
                )
            )
            continue
        recorded = target.values.get(site)
        if recorded is None:
            chain.stages.append(
                StageError(site, stage.name, layer, NOT_OBSERVED, detail="declared, but not called in this run", inputs=inputs)
            )
            continue
        tgt_value = _value(target, site, {**widths, **_widths_of(reference, recorded.where.split)})
        assert tgt_value is not None  # recorded: `_value` gives its tensor or why it cannot
        if isinstance(tgt_value, str):
            chain.stages.append(StageError(site, stage.name, layer, NOT_COMPARABLE, detail=tgt_value, inputs=inputs))
            continue
        width = widths[site]
        sides = [align(v, s, stage, width, site) for v, s in ((gold_value, golden), (ref_value, reference), (tgt_value, target))]
        problem = next((s for s in sides if isinstance(s, str)), None)
        if problem is None:
            gold, ref, tgt = (s for s in sides if isinstance(s, torch.Tensor))
            if not (gold.shape == ref.shape == tgt.shape):
                problem = (
                    f"compared rows differ: golden {tuple(gold.shape)}, reference {tuple(ref.shape)}, target {tuple(tgt.shape)}"
                )
        if problem is not None:
            chain.stages.append(StageError(site, stage.name, layer, NOT_COMPARABLE, detail=problem, inputs=inputs))
            continue
        if gold.numel() == 0:
            continue  # no compared token reaches this stage (an expert no token of the case takes)
        status, value, bound, note = _compare(stage, gold, ref, tgt, site)
        chain.stages.append(StageError(site, stage.name, layer, status, value, bound, note or stage.what, inputs))
    chain.widths = {**widths, **_widths_of(reference, tuple(reference.values))}
    chain.blamed = _blame(chain)
    if chain.blamed is not None:
        blamed = chain.blamed
        chain.blamed = StageError(
            blamed.site,
            blamed.stage,
            blamed.layer,
            blamed.status,
            blamed.value,
            blamed.bound,
            blamed.detail,
            tuple(_observable_inputs(chain, blamed.site)),
        )
    return chain


def _value(side: Side, site: str, widths: Mapping[str, int]) -> torch.Tensor | str | None:
    """The site's value on `side`, a fused declaration's part cut out (None: not recorded)."""
    recorded = side.values.get(site)
    if recorded is None:
        return None
    where = recorded.where
    return _split(recorded.value, where.split, where.part, widths) if where.split else recorded.value


def _widths_of(side: Side, sites: tuple[str, ...]) -> dict[str, int]:
    """The reference's widths of `sites` (the parts of a fused declaration), unsplit values only."""
    return {s: _width(r.value) for s in sites if (r := side.values.get(s)) is not None and not r.where.split}


def _observable_inputs(chain: Chain, site: str, seen: set[str] | None = None) -> list[str]:
    """The judged sites `site` reads, walking through stages that are not judged to their inputs."""
    seen = set() if seen is None else seen
    me = chain.stage(site)
    out: list[str] = []
    for name in me.inputs if me else ():
        if name in seen:
            continue
        seen.add(name)
        stage = chain.stage(name)
        if stage is None:
            continue
        out += [name] if stage.judged else _observable_inputs(chain, name, seen)
    return list(dict.fromkeys(out))


def _blame(chain: Chain) -> StageError | None:
    for stage in chain.stages:
        if stage.status != FAIL:
            continue
        inputs = _observable_inputs(chain, stage.site)
        if all(found.status == PASS for found in filter(None, map(chain.stage, inputs))):  # each input has its stage
            return stage
    return None

"""Stages: the named steps of a model family's computation, and how a target says where each one is.

A gate row says *that* a layer diverges; the stages say *where inside it*. Each family has one
vocabulary of stages in execution order (`VOCABULARY`), each stage naming the stages whose
outputs it reads. The reference declares, for every stage, which of its modules (or functions)
produces it; a target declares the same in its adapter's `stage_map`. A stage a target does not
declare is reported "not observable", never guessed (docs/localise.md §1).

A declaration is a `Tap`: a module path under the adapter's `module` (hooked in every execution
mode, the way `parity.observe.taps` records), optionally with `{layer}` in it, reading the
module's output (or one element of a tuple output, or its first input), or a `Call` of a
module-level function (recorded in eager runs only). A fused module declares several stages at
once: `fused("model.layers.{layer}.self_attn.qkv_proj", "q", "k", "v")` splits its output's last
dimension into the widths the reference's own q, k and v have in this run.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

Layout = Literal["tokens", "heads", "heads_first"]
# The rows a stage covers: "all", AR's "und" / "gen" (from `Side.gen_mask`), or the name of a row
# set the case's sides give (`Side.row_sets`: the routing family's "real" rows, before the count).
Rows = str
# How many blocks a model has: one count for a vocabulary with one block list (the AR decoder's
# `layer`s), else a count per block list (the DiT's context refiner, noise refiner and layers)
Layers = int | Mapping[str, int]


@dataclass(frozen=True)
class Stage:
    """One stage of a family's computation. `inputs` are the stages whose outputs it reads (a name
    of this layer, or `prev:<name>` for the previous layer's stage, which at layer 0 is the
    family's `entry`); `rows`: which tokens the stage sees (an expert sees only its own, a router's
    selection only the rows before the valid-row count)."""

    name: str
    what: str
    inputs: tuple[str, ...] = ()
    per_layer: bool = False
    rows: Rows = "all"


@dataclass(frozen=True)
class Blocks:
    """A list of repeated blocks the per-layer stages run in, block by block: its sites are
    `{name}.{i}.{stage}` and a stage map spells them `{name}.{layer}.{stage}`. `entry`: what `prev:`
    reads at its first block, as sites (a stage outside the blocks, or `<blocks>:<stage>` for that
    stage of the last block of an earlier list); empty: the vocabulary's `entry`."""

    name: str
    entry: tuple[str, ...] = ()


class ChainSite(NamedTuple):
    """One site of a chain: its stage, its block index and block list (None outside the blocks),
    and the stage-map key that declares it."""

    site: str
    stage: Stage
    layer: int | None
    blocks: str | None
    key: str


@dataclass(frozen=True)
class Vocabulary:
    """A family's stages in execution order; per-layer stages repeat for every block of each
    block list in turn (`blocks`, one list `layer` unless the family says otherwise), in between
    the stages before and after them."""

    family: str
    stages: tuple[Stage, ...]
    entry: str  # what `prev:` means at layer 0 (of a block list without an entry of its own)
    blocks: tuple[Blocks, ...] = (Blocks("layer"),)

    def __post_init__(self) -> None:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.family}: duplicate stage names in {names}")
        lists = [b.name for b in self.blocks]
        if not lists or len(set(lists)) != len(lists):
            raise ValueError(f"{self.family}: block lists must be named once each, got {lists}")
        for i, blocks in enumerate(self.blocks):
            for item in blocks.entry:
                source, sep, _ = item.partition(":")
                if sep and source not in lists[:i]:
                    raise ValueError(f"{self.family}: {blocks.name}'s entry {item!r} names no earlier block list ({lists[:i]})")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def key(self, stage: Stage, blocks: str | None = None) -> str:
        """How a stage map spells it: `layer.{layer}.q` for a per-layer stage (in block list
        `blocks`, the first one by default), else its name."""
        return f"{blocks or self.blocks[0].name}.{{layer}}.{stage.name}" if stage.per_layer else stage.name

    def keys(self) -> tuple[str, ...]:
        return tuple(k for s in self.stages for k in ([self.key(s, b.name) for b in self.blocks] if s.per_layer else [s.name]))

    def counts(self, layers: Layers) -> dict[str, int]:
        """The number of blocks in each block list."""
        lists = [b.name for b in self.blocks]
        if isinstance(layers, Mapping):
            unknown = sorted(set(layers) - set(lists))
            if unknown:
                raise ValueError(f"{self.family}: no block lists {unknown} (the lists are {lists})")
            return {name: int(layers.get(name, 0)) for name in lists}
        if len(lists) != 1:
            raise ValueError(f"{self.family}: give a block count for each of {lists}, not one count")
        return {lists[0]: int(layers)}

    def sites(self, layers: Layers) -> list[ChainSite]:
        """Every site in execution order for a model with `layers` blocks."""
        counts = self.counts(layers)
        first = self._first_layer_stage()
        before = [s for i, s in enumerate(self.stages) if not s.per_layer and i < first]
        after = [s for i, s in enumerate(self.stages) if not s.per_layer and i >= first]
        per_layer = [s for s in self.stages if s.per_layer]
        out = [ChainSite(s.name, s, None, None, s.name) for s in before]
        for blocks in self.blocks:
            for layer in range(counts[blocks.name]):
                out += [
                    ChainSite(f"{blocks.name}.{layer}.{s.name}", s, layer, blocks.name, self.key(s, blocks.name))
                    for s in per_layer
                ]
        out += [ChainSite(s.name, s, None, None, s.name) for s in after]
        return out

    def chain(self, layers: Layers) -> list[tuple[str, Stage, int | None]]:
        """(site, stage, layer) in execution order for a model with `layers` blocks."""
        return [(s.site, s.stage, s.layer) for s in self.sites(layers)]

    def _first_layer_stage(self) -> int:
        for i, s in enumerate(self.stages):
            if s.per_layer:
                return i
        return len(self.stages)

    def input_sites(self, stage: Stage, layer: int | None, layers: Layers, blocks: str | None = None) -> list[str]:
        """The sites `stage` at `layer` (of block list `blocks`, the first by default) reads, spelt
        as `chain` spells them: `prev:` at a list's first block is that list's entry, `last:` the
        last block of the last list that has blocks."""
        counts = self.counts(layers)
        lists = [b.name for b in self.blocks]
        group = blocks or lists[0]
        sites: list[str] = []
        for name in stage.inputs:
            if name.startswith("prev:"):
                prev = name.removeprefix("prev:")
                sites += self._entry_sites(lists.index(group), counts) if not layer else [f"{group}.{layer - 1}.{prev}"]
            elif name.startswith("last:"):
                sites += self._last_sites(len(lists) - 1, name.removeprefix("last:"), counts)
            elif layer is not None and self.stage(name).per_layer:
                sites.append(f"{group}.{layer}.{name}")
            else:
                sites.append(name)
        return sites

    def _entry_sites(self, index: int, counts: Mapping[str, int]) -> list[str]:
        entry = self.blocks[index].entry
        if not entry:
            return [self.entry]
        sites: list[str] = []
        for item in entry:
            source, sep, stage = item.partition(":")
            sites += self._last_sites([b.name for b in self.blocks].index(source), stage, counts) if sep else [item]
        return sites

    def _last_sites(self, index: int, stage: str, counts: Mapping[str, int]) -> list[str]:
        """`stage` of the last block of list `index`, or what that list reads when it has none."""
        name = self.blocks[index].name
        return [f"{name}.{counts[name] - 1}.{stage}"] if counts[name] else self._entry_sites(index, counts)


@dataclass(frozen=True)
class Tap:
    """Where a stage's value is read: module `path` under the adapter's `module` (`{layer}` is
    replaced by the layer index), its output, element `output` of a tuple output, or with
    `input=True` its first input. `layout`: "tokens" `[..., features]`, "heads" `[batch, tokens, heads,
    dim]`, "heads_first" `[batch, heads, tokens, dim]` (both read as features `heads * dim`).
    `split`/`part`: a fused output whose last dimension holds the stages `split`, this is `part`."""

    path: str
    output: int | None = None
    input: bool = False
    layout: Layout = "tokens"
    split: tuple[str, ...] = ()
    part: str = ""


@dataclass(frozen=True)
class Call:
    """A stage produced by a module-level function, `package.module:function`: its return value
    (element `output` of a tuple) or, with `input=True`, its first argument. Recorded in eager runs
    only (a function is patched for the duration of the run, which a graph cannot see)."""

    function: str
    output: int | None = None
    input: bool = False
    layout: Layout = "tokens"
    split: tuple[str, ...] = field(default=())
    part: str = ""

    @property
    def path(self) -> str:
        return self.function


Where = Tap | Call


def fused(path: str, *stages: str, layout: Layout = "tokens", output: int | None = None) -> dict[str, Tap]:
    """Declarations for a fused module: `fused("...qkv_proj", "layer.{layer}.q", "layer.{layer}.k",
    "layer.{layer}.v")` reads one output and splits its last dimension into the reference's widths
    of those stages, in this order."""
    names = tuple(stages)
    return {name: Tap(path, output=output, layout=layout, split=names, part=name) for name in names}


# A stage may be declared as several alternatives: the first one the run called is read (a decode
# step that rotates q inside a fused cache-write kernel, a prefill that rotates it in a module).
Declaration = Where | tuple[Where, ...]
StageMap = Mapping[str, Declaration]


def alternatives(declaration: Declaration) -> tuple[Where, ...]:
    return declaration if isinstance(declaration, tuple) else (declaration,)


_OPTIONS = {"output", "input", "layout", "split", "part"}
LAYOUTS = ("tokens", "heads", "heads_first")


def nearest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The valid names nearest to `name` (difflib's ratio, best first), for "did you mean"."""
    return difflib.get_close_matches(str(name), list(dict.fromkeys(candidates)), n=n, cutoff=0.6)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """` (did you mean 'a' or 'b'?)`, or '' when no valid name is near."""
    near = nearest(name, candidates)
    if not near:
        return ""
    spelt = [repr(n) for n in near]
    return f" (did you mean {', '.join(spelt[:-1]) + ' or ' + spelt[-1] if len(spelt) > 1 else spelt[0]}?)"


def _parse_one(key: str, raw: object, who: str) -> Where | list[str]:
    """A declaration in plain data, as a model package that imports nothing from parity writes it:
    a module path (its output), or a dict with `module` or `function` and the `Tap` options; else
    every problem with its form, one line each."""
    if isinstance(raw, (Tap, Call)):
        return raw
    if isinstance(raw, str):
        return Tap(raw)
    if not isinstance(raw, Mapping):
        return [f"{who}: stage_map[{key!r}] must be a module path, a dict, a Tap or a Call, got {type(raw).__name__}"]
    heads = [k for k in ("module", "function") if k in raw]
    problems = []
    for unknown in sorted(set(map(str, raw)) - _OPTIONS - {"module", "function"}):
        problems.append(
            f"{who}: stage_map[{key!r}]: unknown key {unknown!r}{did_you_mean(unknown, [*_OPTIONS, 'module', 'function'])} "
            f"(options: {', '.join(sorted(_OPTIONS))})"
        )
    if len(heads) != 1:
        problems.append(
            f"{who}: stage_map[{key!r}]: a declaration dict needs exactly one of 'module' or 'function', got {heads or 'neither'}"
        )
    if problems:  # the rest of its form too, so one pass over the map finds everything
        layout = raw.get("layout", "tokens")
        if layout not in LAYOUTS:
            problems.append(
                f"{who}: stage_map[{key!r}]: layout {layout!r} is not one of {', '.join(LAYOUTS)}{did_you_mean(str(layout), LAYOUTS)}"
            )
        return problems
    options: dict[str, Any] = {k: (tuple(v) if k == "split" else v) for k, v in raw.items() if k in _OPTIONS}
    if options.get("split") and not options.get("part"):
        options["part"] = key  # a fused declaration written under the stage it gives
    return Tap(raw["module"], **options) if heads == ["module"] else Call(raw["function"], **options)


def parse_map(raw: object, *, who: str) -> tuple[dict[str, Declaration], list[str]]:
    """The declarations of `raw` (a target's `stage_map`) and what is wrong with its form."""
    if not isinstance(raw, Mapping):
        return {}, [f"{who}: stage_map must be a mapping of stage name to declaration, got {type(raw).__name__}"]
    parsed: dict[str, Declaration] = {}
    problems = []
    for key, value in raw.items():
        items = value if isinstance(value, (list, tuple)) and not isinstance(value, str) else (value,)
        declared = [_parse_one(key, item, who) for item in items]
        problems += [line for d in declared if isinstance(d, list) for line in d]
        wheres = tuple(d for d in declared if not isinstance(d, list))
        if wheres:
            parsed[key] = wheres if len(wheres) > 1 else wheres[0]
    return parsed, problems


def map_problems(vocabulary: Vocabulary, stage_map: object, *, who: str) -> list[str]:
    """Everything wrong with a declared map's form, one line each, all at once: each unknown stage
    name with the nearest names of the vocabulary, each malformed declaration (the module paths are
    checked against a built model by `parity.localise.observe.missing_paths`)."""
    stage_map, problems = parse_map(stage_map, who=who)
    keys = vocabulary.keys()
    for key, declaration in stage_map.items():
        if key not in keys:
            hint = did_you_mean(key, keys) or did_you_mean(key, _spellings(vocabulary))
            hint = hint or f"; no {vocabulary.family} stage is near it (the stages: docs/localise.md §2)"
            problems.append(f"{who}: stage_map names unknown stage {key!r}{hint}")
            continue
        for where in alternatives(declaration):
            problems += _declaration_problems(key, where, who)
    return problems


def _spellings(vocabulary: Vocabulary) -> list[str]:
    """The vocabulary's keys, and each per-layer key as a porter might write it with a layer number
    (`layer.0.q`), so a key spelt with an index still finds its stage."""
    keys = vocabulary.keys()
    return [*keys, *(k.replace("{layer}", "0") for k in keys if "{layer}" in k)]


def _declaration_problems(key: str, where: object, who: str) -> list[str]:
    problems = []
    if not isinstance(where, (Tap, Call)):
        return [f"{who}: stage_map[{key!r}] must be a Tap or a Call (or a tuple of them), got {type(where).__name__}"]
    if where.split and (key not in where.split or where.part != key):
        problems.append(f"{who}: stage_map[{key!r}] splits {where.path} into {where.split} but is part {where.part!r}")
    if isinstance(where, Call) and (where.function.count(":") != 1):
        problems.append(f"{who}: stage_map[{key!r}]: Call needs 'package.module:function', got {where.function!r}")
    if where.layout not in LAYOUTS:
        problems.append(
            f"{who}: stage_map[{key!r}]: layout {where.layout!r} is not one of {', '.join(LAYOUTS)}{did_you_mean(where.layout, LAYOUTS)}"
        )
    return problems


def sites_of(key: str, layer: int | None) -> str:
    return key.replace("{layer}", str(layer)) if layer is not None else key

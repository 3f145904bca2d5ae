"""Checking a target's stage map before any run: `parity check-target` prints one line per problem."""

from __future__ import annotations

from typing import Any

from parity.localise.observe import missing_paths, resolve
from parity.localise.stages import Layers, map_problems
from parity.localise.vocabulary import vocabulary


def stage_map_report(adapter: Any, family: str, layers: Layers, *, root: Any = None) -> tuple[list[str], str]:
    """(problems, what was checked) for `adapter.stage_map` against `family`'s vocabulary and the
    adapter's model (`root`, default `adapter.module`): unknown stage names, malformed declarations,
    modules the model does not have, functions that cannot be imported. No map is no problem: every
    stage is then reported "not observable" when a case fails."""
    stage_map = getattr(adapter, "stage_map", None)
    vocab = vocabulary(family)
    if stage_map is None:
        return [], "no stage_map: a failing case's stages are reported not observable (docs/localise.md §1)"
    who = f"{type(adapter).__name__}.stage_map"
    root = getattr(adapter, "module", None) if root is None else root
    # every problem at once: the form of each declaration and, for those well formed, whether the
    # model has what they name (a porter fixes the map in one pass, docs/localise.md §1)
    problems = map_problems(vocab, stage_map, who=who) + missing_paths(root, stage_map, layers, who=who)
    if problems:
        return problems, ""
    resolved = resolve(root, stage_map, vocab, layers)
    declared = len(set(stage_map) & set(vocab.keys()))
    return [], f"stage_map: {declared} of {len(vocab.keys())} {family} stages declared, {len(resolved.sites)} sites on this model"

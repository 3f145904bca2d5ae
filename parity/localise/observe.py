"""Recording stage values on one side: resolve a stage map against a built model, tap it, read the taps.

Module taps are forward hooks (`parity.observe.taps.TapSet`), so they record in every execution
mode a runner offers; function taps (`Call`) replace a module-level function for the duration of
one eager run. A tapped module or function called more than once in the run gives its calls
stacked along the first dimension, a call's vector as one row (the reference router's per-row
calls become one table).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import re
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parity.localise.stages import (
    Call,
    Layers,
    StageMap,
    Tap,
    Vocabulary,
    Where,
    alternatives,
    did_you_mean,
    parse_map,
    sites_of,
)
from parity.observe.taps import Taps, TapSet


@dataclass(frozen=True)
class Resolved:
    """A stage map bound to one model: the declaration behind every site it observes."""

    sites: dict[str, tuple[Where, ...]]  # site ("layer.0.q") -> its declarations, the paths' {layer} filled in
    undeclared: tuple[str, ...]  # stage keys of the vocabulary the map does not name
    layers: Layers

    def modules(self, root: nn.Module) -> dict[str, nn.Module]:
        """Module path -> module, one entry per tapped module (what a runner's `taps=` takes)."""
        return {w.path: root.get_submodule(w.path) for ws in self.sites.values() for w in ws if isinstance(w, Tap)}

    def functions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(w.function for ws in self.sites.values() for w in ws if isinstance(w, Call)))


def _has(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def _function_exists(spec: str) -> bool:
    module_name, _, name = spec.partition(":")
    try:
        return callable(getattr(importlib.import_module(module_name), name, None))
    except ImportError:
        return False


def resolve(root: nn.Module | None, stage_map: StageMap, vocabulary: Vocabulary, layers: Layers) -> Resolved:
    """Bind `stage_map` to `root`: a per-layer declaration whose module is absent on a layer
    (the gen expert of a layer without one) gives no site there."""
    stage_map, _ = parse_map(stage_map, who="stage_map")  # its problems are check-target's to report
    sites: dict[str, tuple[Where, ...]] = {}
    for site, _, layer, _, key in vocabulary.sites(layers):
        declaration = stage_map.get(key)
        if declaration is None:
            continue
        bound = []
        for where in alternatives(declaration):
            if isinstance(where, Tap):
                path = sites_of(where.path, layer)
                if root is None or not _has(root, path):
                    continue
                split = tuple(sites_of(s, layer) for s in where.split)
                where = Tap(path, where.output, where.input, where.layout, split, sites_of(where.part, layer))
            bound.append(where)
        if bound:
            sites[site] = tuple(bound)
    undeclared = tuple(k for k in vocabulary.keys() if k not in stage_map)  # noqa: SIM118 (a method, not a dict)
    return Resolved(sites, undeclared, layers)


def missing_paths(root: nn.Module | None, stage_map: StageMap, layers: Layers, *, who: str) -> list[str]:
    """A declared module that exists on no layer, or a function that cannot be imported: one line
    each, with the model's (or the module's) nearest names."""
    problems = []
    stage_map, _ = parse_map(stage_map, who=who)
    layers = max(layers.values(), default=0) if isinstance(layers, Mapping) else layers
    module_paths: list[str] | None = None
    for key, declaration in stage_map.items():
        for where in alternatives(declaration):
            if isinstance(where, Call) and not _function_exists(where.function):
                problems.append(
                    f"{who}: stage_map[{key!r}] names function {where.function!r}, which cannot be imported"
                    + _nearest_function(where.function)
                )
            if not isinstance(where, Tap):
                continue
            paths = [sites_of(where.path, layer) for layer in range(max(layers, 1))] if "{layer}" in where.path else [where.path]
            if root is None or not any(_has(root, p) for p in paths):
                if module_paths is None:
                    module_paths = _module_spellings(root)
                problems.append(
                    f"{who}: stage_map[{key!r}] names module {where.path!r}, which the model does not have"
                    + did_you_mean(where.path, module_paths)
                )
    return problems


def _module_spellings(root: nn.Module | None) -> list[str]:
    """Every module path of `root`, and each with its block index written `{layer}` (how a map spells it)."""
    if root is None:
        return []
    paths = [name for name, _ in root.named_modules() if name]
    return list(dict.fromkeys([*(re.sub(r"(?<=\.)\d+(?=\.|$)", "{layer}", p) for p in paths), *paths]))


def _nearest_function(spec: str) -> str:
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return ""
    names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
    return did_you_mean(f"{module_name}:{name}", [f"{module_name}:{n}" for n in names])


@contextlib.contextmanager
def recording_functions(specs: tuple[str, ...]) -> Iterator[dict[str, list[tuple[Any, Any]]]]:
    """Replace each `package.module:function` by a recorder of (first argument, result) while inside."""
    store: dict[str, list[tuple[Any, Any]]] = {spec: [] for spec in specs}
    originals = []
    for spec in specs:
        module_name, _, name = spec.partition(":")
        module = importlib.import_module(module_name)
        original = getattr(module, name)

        def recorder(*args: Any, _original: Callable = original, _calls: list = store[spec], **kwargs: Any) -> Any:
            result = _original(*args, **kwargs)
            first = args[0] if args else next(iter(kwargs.values()), None)
            _calls.append((_copy(first), _copy(result)))
            return result

        originals.append((module, name, original))
        setattr(module, name, recorder)
    try:
        yield store
    finally:
        for module, name, original in reversed(originals):
            setattr(module, name, original)


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v) for v in value) if not hasattr(value, "_fields") else type(value)(*(_copy(v) for v in value))
    return value


def _pick(call: tuple[Any, Any], where: Where) -> Any:
    value = call[0] if where.input else call[1]
    if where.output is not None and not where.input and isinstance(value, (tuple, list)):
        value = value[where.output]  # a module that returns a plain tensor on some calls is read whole
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if where.layout == "heads_first":  # [B, H, L, D] -> [B, L, H * D]
        b, h, length, d = value.shape
        value = value.transpose(1, 2).reshape(b, length, h * d)
    elif where.layout == "heads":  # [B, L, H, D] -> [B, L, H * D]
        value = value.flatten(-2)
    return value


_FRAMES = itertools.count()


def fresh_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` behind a code object of its own, for a compiled run that must trace the stage taps.

    Dynamo caches compiled frames per code object and, by default, does not guard a cached graph on
    the forward hooks of modules that had none when it was traced
    (`torch._dynamo.config.skip_nnmodule_hook_guards`). A suite compiles the target's `forward`
    first without the stage taps; a tapped run of the same `forward` would replay that graph and
    record nothing. A new code object has an empty cache, so Dynamo traces it, and the modules it
    inlines, with the taps as they are now; the graph dies with the wrapper (docs/localise.md §1)."""

    def observed(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    code = observed.__code__.replace(co_name=f"parity_observed_{next(_FRAMES)}")
    wrapper = types.FunctionType(code, observed.__globals__, code.co_name, observed.__defaults__, observed.__closure__)
    wrapper.__qualname__ = f"{getattr(fn, '__qualname__', code.co_name)} (observed)"
    return wrapper


def unobserved_sites(compiled: Mapping[str, Recorded | None], eager: Mapping[str, Recorded | None]) -> list[str]:
    """Module sites the eager run recorded and the compiled run did not: its taps did not fire there
    (a function stage is recorded in eager runs only, by design)."""
    return [
        site for site, value in eager.items() if value is not None and isinstance(value.where, Tap) and compiled.get(site) is None
    ]


@dataclass(frozen=True)
class Recorded:
    """A site's value (calls stacked along dim 0) and the declaration it came from."""

    value: torch.Tensor
    where: Where


def stage_values(
    resolved: Resolved, module_taps: Taps | Mapping[str, list], function_calls: Mapping[str, list]
) -> dict[str, Recorded | None]:
    """Site -> what it recorded (the first of its declarations the run called), or None."""
    values: dict[str, Recorded | None] = {}
    for site, declarations in resolved.sites.items():
        values[site] = None
        for where in declarations:
            if isinstance(where, Tap):
                calls = [(c.input, c.output) if hasattr(c, "output") else c for c in module_taps.get(where.path, [])]
            else:
                calls = list(function_calls.get(where.function, []))
            if calls:
                picked = [_pick(call, where) for call in calls]  # type: ignore[arg-type]  # a plain mapping's calls are (input, output) pairs already
                # A call giving a scalar or a vector is one row (a per-row function's calls make a table).
                value = (
                    picked[0] if len(picked) == 1 else torch.cat([p.reshape(1, *p.shape) if p.dim() <= 1 else p for p in picked])
                )
                values[site] = Recorded(value, where)
                break
    return values


def observe_eager(root: nn.Module | None, resolved: Resolved, run: Callable[[], Any]) -> tuple[Any, dict[str, Recorded | None]]:
    """Run `run()` eagerly with every site of `resolved` tapped; its output and the site values."""
    taps = TapSet(resolved.modules(root) if root is not None else {})
    try:
        with recording_functions(resolved.functions()) as calls, torch.no_grad():
            output = run()
        return output, stage_values(resolved, taps.snapshot(), calls)
    finally:
        taps.remove()

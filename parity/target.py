"""Resolving `--target`: which implementation the suites run against.

`serving` (the built-in serving-style models) and `reference` (the upstream-faithful models: a
valid, trivially passing run) are names for factories in the model packages; anything else is
`package.module:factory`, a zero-argument callable returning a target object. The harness imports
the factory by name only when a suite asks for the target, so `parity/` itself imports no model.
"""

from __future__ import annotations

import importlib
from typing import Any

BUILTIN_TARGETS = {
    "serving": "serving_models.target:make_target",
    "reference": "reference_models.target:make_target",
}


class TargetError(RuntimeError):
    """`--target` names something that cannot be loaded; the message says what and why."""


def factory_path(spec: str) -> str:
    """`serving` -> `serving_models.target:make_target`; `pkg.mod:fn` is returned unchanged."""
    if spec in BUILTIN_TARGETS:
        return BUILTIN_TARGETS[spec]
    if ":" not in spec:
        raise TargetError(
            f"--target {spec!r}: expected one of {', '.join(BUILTIN_TARGETS)} or 'package.module:factory'"
        )
    return spec


def load_target(spec: str) -> Any:
    """Import and call the target factory named by `spec`; the object it returns is the target."""
    path = factory_path(spec)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetError(f"--target {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise TargetError(f"--target {spec!r}: module {module_name!r} has no callable {attr!r}")
    target = factory()
    if not getattr(target, "name", None):
        raise TargetError(f"--target {spec!r}: the factory returned {type(target).__name__} without a 'name'")
    return target

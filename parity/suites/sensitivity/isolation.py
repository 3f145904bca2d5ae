"""Several pytest sessions in one process, each leaving the process as it found it.

A mutant is a run-time change of named functions, classes and constants of the built-in target or
of the harness (`parity/suites/sensitivity/catalogue.py`): attributes of loaded modules and of the
classes they define. `ModuleSnapshot` records those attributes before a session and puts every
one back after it (changed, added or removed), so the next session in the same process sees the
shipped code again. Between sessions the process also drops what a session built: the resident
models (`parity.suites.conftest.RESIDENT`), Dynamo's compiled frames and counters, and the
compiler stance. A session's patches that reach outside these packages (torch itself), or state a
mutant mutates in place (a warn-once registry) are not undone here: such a mutant is marked
`isolated` in the catalogue and gets a process of its own.

`restore()` returns what it had to put back, and `leftovers()` what still differs afterwards: a
session that changed something the snapshot cannot restore is reported, never silently carried
into the next one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

# The packages whose modules a mutant patches: the built-in target, the reference (never patched,
# but a session must not leak into it either) and the harness (runner and review mutants).
PACKAGES = ("serving_models", "reference_models", "parity")
_MISSING = object()


def preload() -> None:
    """Import every module of `PACKAGES` that is not a test module, so the first snapshot covers a
    module a mutant imports only when it applies itself (test modules stay pytest's to import, with
    its assertion rewriting)."""
    import importlib
    import pkgutil

    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package_name}."):
            leaf = info.name.rsplit(".", 1)[-1]
            if leaf.startswith(("test_", "bench_")) or leaf in ("conftest", "__main__"):
                continue
            try:
                importlib.import_module(info.name)
            except ImportError:  # an optional dependency (a GPU kernel library) that is not installed
                continue


def _watched_modules() -> dict[str, ModuleType]:
    return {
        name: module
        for name, module in list(sys.modules.items())
        if isinstance(module, ModuleType) and name.split(".", 1)[0] in PACKAGES
    }


def _classes_of(module: ModuleType) -> Iterator[type]:
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            yield value


class ModuleSnapshot:
    """Attributes of every loaded module of `PACKAGES` and of the classes each defines."""

    def __init__(self) -> None:
        self.modules = _watched_modules()
        self.module_attrs = {name: dict(vars(module)) for name, module in self.modules.items()}
        self.class_attrs = {cls: dict(vars(cls)) for module in self.modules.values() for cls in _classes_of(module)}

    @staticmethod
    def _put_back(owner: Any, saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
        changed = []
        for key in set(saved) | set(current):
            if key in ("__dict__", "__weakref__"):
                continue
            before, now = saved.get(key, _MISSING), current.get(key, _MISSING)
            if before is now or (before is _MISSING and isinstance(now, ModuleType)):
                continue  # unchanged, or a submodule imported during the session (it stays imported)
            if before is _MISSING:
                delattr(owner, key)
            else:
                setattr(owner, key, before)
            changed.append(key)
        return changed

    def restore(self) -> list[str]:
        """Put back every attribute a session changed; returns `module.attr` / `module.Class.attr` names."""
        changed = []
        for name, module in self.modules.items():
            changed += [f"{name}.{key}" for key in self._put_back(module, self.module_attrs[name], dict(vars(module)))]
        for cls, saved in self.class_attrs.items():
            changed += [f"{cls.__module__}.{cls.__qualname__}.{key}" for key in self._put_back(cls, saved, dict(vars(cls)))]
        return sorted(changed)

    def leftovers(self) -> list[str]:
        """What still differs from the snapshot (nothing, after a successful `restore`)."""
        diffs = []
        for name, module in self.modules.items():
            now = vars(module)
            diffs += [f"{name}.{k}" for k, v in self.module_attrs[name].items() if now.get(k, _MISSING) is not v]
        for cls, saved in self.class_attrs.items():
            now = vars(cls)
            diffs += [
                f"{cls.__qualname__}.{k}"
                for k, v in saved.items()
                if k not in ("__dict__", "__weakref__") and now.get(k, _MISSING) is not v
            ]
        return diffs


def drop_session_state() -> None:
    """Forget what the last session built: resident models, compiled frames, the compiler stance."""
    import gc

    conftest = sys.modules.get("parity.suites.conftest")
    if conftest is not None:
        conftest.RESIDENT.release()
    gc.collect()  # the models go before Dynamo's tables: their weakref callbacks expect those tables
    from parity.observe.compile_ledger import reset_compile_state

    reset_compile_state()


@contextmanager
def isolated_session() -> Iterator[ModuleSnapshot]:
    """Around one in-process pytest session: snapshot before, restore and clean up after."""
    snapshot = ModuleSnapshot()
    try:
        yield snapshot
    finally:
        # Dropped first: Dynamo's cleanups of the frames a session compiled delete the globals those
        # frames added to the modules (`__builtins_dict___N`); restored first, the modules had lost
        # them already and every cleanup printed a KeyError into the session's log, under its summary.
        drop_session_state()
        snapshot.restore()

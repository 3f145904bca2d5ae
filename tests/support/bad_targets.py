"""Broken `--target` factories for tests/harness/test_bad_inputs.py: a target without one model family,
a factory that raises, one whose object has no name, one that is not callable."""

from __future__ import annotations

from typing import Any

from serving_models.target import make_target as make_serving


class Without:
    """The built-in serving target with some members hidden (a port that has not written them)."""

    def __init__(self, *missing: str) -> None:
        self._target = make_serving()
        self._missing = set(missing)
        self.name = "serving-without-" + "-".join(sorted(missing))

    def __getattr__(self, name: str) -> Any:
        if name in self._missing:
            raise AttributeError(name)
        return getattr(self._target, name)


def no_router() -> Without:
    return Without("router")


def no_dit() -> Without:
    return Without("load_dit", "build_dit")


def no_ar() -> Without:
    return Without("load_ar", "build_ar")


def raises() -> Any:
    raise RuntimeError("the engine's weights path is not set\n(set ENGINE_WEIGHTS)")


class _Nameless:
    pass


def nameless() -> _Nameless:
    return _Nameless()


NOT_CALLABLE = 42

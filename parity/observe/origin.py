"""Where in the target's own code an error came from: the innermost frame outside torch and parity.

An error row that says `RuntimeError: ...` without a place sends a porter to the terminal's
traceback; the place they edit is the innermost frame of *their* code, below parity's suites and
above torch's internals (a host read `bool(mask.any())` at `model.py:179`). Three kinds of errors
hide it differently, and each is read where it keeps it:

* a Python error of the target's code, or a graph capture refused inside one of its ops: the
  target's frames are in the traceback (the capture guard raises while the target's op runs);
* an error re-raised by a runner or a suite (`raise ... from exc`): the frames are in the cause;
* a Dynamo error: Dynamo executes the target's code symbolically, so the Python traceback holds
  only Dynamo's frames; Dynamo keeps the user's stack on the exception as `real_stack`.
"""

from __future__ import annotations

import importlib.util
import os
import sysconfig
import traceback
from pathlib import Path

# Code that is never the target's: torch (Dynamo, Inductor, functorch live inside it), parity
# itself, the standard library, and the pytest machinery around a test.
_LIBRARIES = tuple(
    os.path.normcase(str(Path(p).resolve())) + os.sep
    for p in (
        Path(
            str(getattr(importlib.util.find_spec("torch"), "origin", ""))
        ).parent,  # found, not imported: the plugin's hooks stay light
        Path(__file__).resolve().parents[1],
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["platstdlib"],
    )
)
_TOOLING = ("_pytest", "pluggy", "triton", "sympy", "functorch", "xdist", "typing_extensions")


def is_library(filename: str) -> bool:
    """Whether a frame's file is torch's, parity's, the standard library's or test tooling's."""
    if not filename or filename.startswith("<"):
        return True
    path = os.path.normcase(str(Path(filename).resolve()))
    return path.startswith(_LIBRARIES) or any(f"{os.sep}{name}{os.sep}" in path for name in _TOOLING)


def _innermost(frames: traceback.StackSummary | list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    return next((frame for frame in reversed(list(frames)) if not is_library(frame.filename)), None)


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or while handling, outermost first."""
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in out:
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def target_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the target's code that `exc` (or what it was raised from) passed
    through; None when every frame is torch's, parity's or the standard library's."""
    found = None
    for link in _chain(exc):
        stack = getattr(link, "real_stack", None)  # Dynamo: the user frames it was tracing
        frame = _innermost(stack) if stack else None
        frame = frame or _innermost(traceback.extract_tb(link.__traceback__))
        found = frame or found  # the deepest link that has one is nearest to where it went wrong
    return found


def place(frame: traceback.FrameSummary) -> str:
    """`path:line` (the path relative to the working directory when under it)."""
    path = Path(frame.filename)
    try:
        shown = str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(path)
    return f"{shown}:{frame.lineno}"


def origin_of(exc: BaseException) -> str:
    """` (at path:line in function)` for the target's frame of `exc`, or "" when there is none."""
    frame = target_frame(exc)
    return f" (at {place(frame)} in {frame.name})" if frame is not None else ""


def calling_place() -> str:
    """` (at path:line in function)` for the innermost frame of the target's code on the current
    stack: a runner refusing an op while the target runs it names the line that called it."""
    frame = _innermost(traceback.extract_stack())
    return f" (at {place(frame)} in {frame.name})" if frame is not None else ""


def error_line(exc: BaseException, limit: int = 2000) -> str:
    """An error row's detail: the type, where in the target's code, and the message on one line
    (`RuntimeError (at engine/model.py:179 in moe): ...`): the place first, where a cut line keeps it."""
    where = origin_of(exc)
    where = "" if where and where in str(exc) else where  # a runner's refusal that names the place already
    return f"{type(exc).__name__}{where}: {exc}".strip().replace("\n", " | ")[:limit]

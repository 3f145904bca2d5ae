"""The frame parity compiles for a decorated method: a code object of its own (docs/capture-and-compile.md §4).

`torch.compile(fn)` compiles the frame of `fn`'s code object, and the compile ledger counts per code
object. A method under a `functools.wraps` decorator (`@torch.no_grad()`, `@torch.inference_mode()`,
an engine's own) has the decorator's wrapper as its code, one code object for every function that
decorator wraps; when the wrapper's file is one Dynamo skips (`torch/utils/_contextlib.py`),
`torch.compile` also calls it through `torch._dynamo.external_utils.wrap_inline`, whose `inner` is
one code object for every such callable in the process. Either way the frame Dynamo compiles is not
the method's: counted by the method's code, it compiled nothing.

So parity compiles a decorated function through a frame of its own: a one-line call of the
decorated function (the decorator still runs, traced by Dynamo), behind a code object made once per
decorated function and named after the function it wraps (`EngineARAdapter.forward`). `code_of`
(the ledger) answers that code object for the function, its bound methods and its compiled
wrappers, so the ledger counts the compiles of this function and nothing else. A function no
decorator wraps is compiled as it is: its own code is already its own.
"""

from __future__ import annotations

import inspect
import itertools
import types
import weakref
from collections.abc import Callable
from typing import Any


def _frame_template(fn: Callable[..., Any]) -> Callable[..., Any]:
    def frame(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return frame


_TEMPLATE = _frame_template(lambda: None).__code__  # free variable `fn`: the callable a frame calls

# decorated function -> the code object of its frames (dies with the function)
_CODES: weakref.WeakKeyDictionary[types.FunctionType, types.CodeType] = weakref.WeakKeyDictionary()
_NUMBERS = itertools.count()
# a frame's code object -> where the function it wraps is defined (`file:line`), for the ledger's rows
_SOURCES: dict[types.CodeType, str] = {}


def decorated_function(fn: Any) -> types.FunctionType | None:
    """The function behind `fn` (a function or a bound method) when a `functools.wraps` decorator
    wraps it (it has `__wrapped__`), else None. `torch.compile`'s own wrappers are not decorators."""
    function = fn.__func__ if inspect.ismethod(fn) else fn
    if not isinstance(function, types.FunctionType) or not hasattr(function, "__wrapped__"):
        return None
    if getattr(function, "_torchdynamo_orig_callable", None) is not None:
        return None
    return function


def frame_code(function: types.FunctionType) -> types.CodeType:
    """The code object every frame of the decorated `function` runs, made on first use and named
    after the function it wraps (the ledger's rows read `Class.method`)."""
    code = _CODES.get(function)
    if code is None:
        wrapped = inspect.unwrap(function)
        name = getattr(wrapped, "__name__", function.__name__)
        qualname = getattr(wrapped, "__qualname__", function.__qualname__)
        # Code objects compare by content, and co_qualname is not part of it: a constant of its own
        # keeps two frames apart wherever code objects are keys (the ledger's call counts).
        code = _TEMPLATE.replace(co_name=name, co_qualname=qualname, co_consts=(*_TEMPLATE.co_consts, f"frame {next(_NUMBERS)}"))
        _CODES[function] = code
        source = getattr(wrapped, "__code__", None)
        if source is not None:
            _SOURCES[code] = f"{source.co_filename}:{source.co_firstlineno}"
    return code


def frame_source(code: types.CodeType) -> str | None:
    """`file:line` of the decorated function whose frames run `code`; None for any other code."""
    return _SOURCES.get(code)


def own_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as parity compiles it: a decorated function or bound method behind its own frame
    (`frame_code`), anything else unchanged."""
    function = decorated_function(fn)
    if function is None:
        return fn
    code = frame_code(function)
    frame = types.FunctionType(code, _frame_template.__globals__, code.co_name, None, (types.CellType(fn),))
    frame.__qualname__ = code.co_qualname
    frame.__doc__ = getattr(fn, "__doc__", None)
    return frame

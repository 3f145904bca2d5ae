"""The compile ledger: what Dynamo compiled, per code object, and why it compiled again.

An all-frames counter passes even when the region under test never compiled, because library code
compiles on its own (vLLM's `SiluAndMul.forward_native` did, vllm-project/vllm-omni#7455). So the ledger counts
per code object, and a suite asks about exactly the code it owns (`TransformerBlock.forward`).

How it sees Dynamo (private APIs, tested on the torch versions in `TESTED_TORCH_VERSIONS`; a
missing one raises `CompileWatchUnavailable` naming it). No public hook serves:
`torch._dynamo.utils.counters` holds process-wide totals without the code object or the reasons,
`torch.compiler` has no compile callbacks (the private `torch._dynamo.callback` registry passes
only a compile id), and `TORCH_LOGS=recompiles` is log text to scrape (docs/capture-and-compile.md §4).

- `torch._dynamo.convert_frame._compile(code, ...)` runs once per frame conversion: first compiles,
  recompiles, and the attempt that finds the recompile limit exceeded. It is looked up as a module
  global at call time, so wrapping the attribute sees every attempt.
- `convert_frame.get_and_maybe_log_recompilation_reasons` returns each recompile's guard-failure
  reasons as text (and raises `RecompileError` under `error_on_recompile`); wrapping it records
  the reasons against the frame being compiled, without turning on `TORCH_LOGS`.
- `convert_frame.exceeds_recompile_limit` says when a code object ran out of cache entries. Past
  that point Dynamo runs the frame eagerly for every new guard miss and only logs a warning
  (with `fullgraph=True` it raises `FailOnRecompileLimitHit` instead). The ledger records the hit
  and counts the calls made since: calls rising while compiles plateau is a failure, not a pass.
- Graph breaks come from `torch._dynamo.utils.counters["graph_break"]` (reason -> count),
  reported as the change since the ledger started.

The ledger is a context manager; ledgers may nest (each sees the events made while it is active).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Literal

import torch
import torch._dynamo
from torch import nn

from parity.observe.compile_frames import decorated_function, frame_code, frame_source

EventKind = Literal["compile", "recompile", "limit_hit", "failed", "skipped"]


# torch (major, minor) versions the wrapped private functions were tested on: 2.11 with CUDA 13.0
# (the GPU lane, H200) and 2.13 CPU (the CPU lane). tests/runners/test_compile_watch_ledger.py fails on any
# other version until the ledger's tests have been run there and the version added here.
TESTED_TORCH_VERSIONS = ((2, 11), (2, 13))


class CompileWatchUnavailable(RuntimeError):
    """This torch lacks a private Dynamo hook the ledger needs."""


@dataclass(frozen=True)
class CompileEvent:
    """One Dynamo frame conversion of one code object."""

    code: CodeType
    kind: EventKind
    reasons: tuple[str, ...] = ()  # guard failures that caused a recompile (empty for a first compile)
    limit_type: str | None = None  # set when the recompile limit was hit
    limit_value: Any = None  # the limit's value at that moment
    error: str | None = None  # the exception text, for limit hits and failed attempts
    raised: bool = False  # the attempt raised to the caller (not swallowed into an eager run)
    calls_at_event: int = 0  # calls of the code's counted callable made when this happened

    @property
    def label(self) -> str:
        return code_label(self.code)


def code_label(code: CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)


def code_location(code: CodeType) -> str:
    """Where the code is defined; for parity's frame of a decorated function, where that function is."""
    return frame_source(code) or f"{code.co_filename}:{code.co_firstlineno}"


def short_reason(text: str) -> str:
    """One line of a Dynamo recompile reason: the guard and its source line, without the stack."""
    kept = []
    for line in text.splitlines():
        if line.strip().startswith("User stack trace"):
            break
        kept.append(line.strip())
    reason = " ".join(part for part in kept if part)
    return re.sub(r"\s+", " ", reason)


def code_of(target: Any) -> CodeType:
    """The code object Dynamo compiles for `target` (function, bound method, module, code object).

    Compiled wrappers (`torch.compile(fn)`), partials, bound methods and call counters are
    unwrapped; a module means its class's `forward`; a decorated function means the frame parity
    compiles it through (`parity.observe.compile_frames`), never the decorator's shared wrapper.
    """
    seen = target
    for _ in range(16):
        if isinstance(target, CodeType):
            return target
        if isinstance(target, type):
            raise TypeError(f"pass a function such as {target.__name__}.forward, not the class {target!r}")
        if isinstance(target, functools.partial):
            target = target.func
        elif getattr(target, "_parity_counted", None) is not None:
            target = target._parity_counted
        elif getattr(target, "_torchdynamo_orig_callable", None) is not None:
            target = target._torchdynamo_orig_callable
        elif isinstance(target, nn.Module):
            target = type(target).forward
        elif inspect.ismethod(target):
            target = target.__func__
        elif (decorated := decorated_function(target)) is not None:
            return frame_code(decorated)
        elif hasattr(target, "__code__"):
            return target.__code__
        else:
            break
    raise TypeError(f"cannot find the code object of {seen!r}")


# --- the patches on torch._dynamo.convert_frame -------------------------------------------------


@dataclass
class _Attempt:
    code: CodeType
    reasons: tuple[str, ...] | None = None
    limit_type: str | None = None
    limit_value: Any = None
    error: BaseException | None = None
    produced: bool = False


class _DynamoTap:
    """Installs the wrappers once for all active ledgers and removes them when the last one exits."""

    REQUIRED = ("_compile", "get_and_maybe_log_recompilation_reasons")
    LIMIT_NAMES = ("exceeds_recompile_limit", "exceeds_cache_size_limit")

    def __init__(self) -> None:
        self.ledgers: list[CompileLedger] = []
        self.saved: dict[str, Any] = {}
        self.lock = threading.RLock()
        self.local = threading.local()

    def _stack(self) -> list[_Attempt]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def attach(self, ledger: CompileLedger) -> None:
        with self.lock:
            if not self.ledgers:
                self._install()
            self.ledgers.append(ledger)

    def detach(self, ledger: CompileLedger) -> None:
        with self.lock:
            self.ledgers.remove(ledger)
            if not self.ledgers:
                self._uninstall()

    def _install(self) -> None:
        from torch._dynamo import convert_frame

        missing = [name for name in self.REQUIRED if not hasattr(convert_frame, name)]
        limit_name = next((n for n in self.LIMIT_NAMES if hasattr(convert_frame, n)), None)
        if limit_name is None:
            missing.append(" or ".join(self.LIMIT_NAMES))
        if missing:
            raise CompileWatchUnavailable(
                f"torch {torch.__version__}: torch._dynamo.convert_frame has no {', '.join(missing)}; "
                "the compile ledger wraps these private functions to count compiles per code "
                "object (update parity/observe/compile_ledger.py for this torch)"
            )
        assert limit_name is not None  # else `missing` names it and the line above raised
        self.saved = {
            "_compile": convert_frame._compile,
            "get_and_maybe_log_recompilation_reasons": convert_frame.get_and_maybe_log_recompilation_reasons,
            limit_name: getattr(convert_frame, limit_name),
        }
        convert_frame._compile = self._wrap_compile(self.saved["_compile"])
        convert_frame.get_and_maybe_log_recompilation_reasons = self._wrap_reasons(
            self.saved["get_and_maybe_log_recompilation_reasons"]
        )
        setattr(convert_frame, limit_name, self._wrap_limit(self.saved[limit_name]))

    def _uninstall(self) -> None:
        from torch._dynamo import convert_frame

        for name, original in self.saved.items():
            setattr(convert_frame, name, original)
        self.saved = {}

    def _wrap_compile(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def watched_compile(*args: Any, **kwargs: Any) -> Any:
            code = kwargs["code"] if "code" in kwargs else args[0]
            attempt = _Attempt(code=code)
            stack = self._stack()
            stack.append(attempt)
            try:
                result = original(*args, **kwargs)
                # torch >= 2.6 returns ConvertFrameReturn(guarded_code=...), older GuardedCode | None
                attempt.produced = getattr(result, "guarded_code", result) is not None
                return result
            except BaseException as error:
                attempt.error = error
                raise
            finally:
                stack.pop()
                for ledger in list(self.ledgers):
                    ledger._record(attempt)

        return watched_compile

    def _wrap_reasons(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def watched_reasons(*args: Any, **kwargs: Any) -> Any:
            stack = self._stack()
            attempt = stack[-1] if stack else None
            try:
                reasons = original(*args, **kwargs)
            except Exception as error:  # error_on_recompile: the RecompileError text holds the reasons
                if attempt is not None:
                    attempt.reasons = (str(error),)
                raise
            if attempt is not None:
                attempt.reasons = tuple(str(r) for r in reasons) or ("Unable to find recompilation reasons",)
            return reasons

        return watched_reasons

    def _wrap_limit(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def watched_limit(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            exceeded, limit_type = result if isinstance(result, tuple) else (bool(result), "recompile_limit")
            stack = self._stack()
            if exceeded and stack:
                stack[-1].limit_type = str(limit_type)
                stack[-1].limit_value = getattr(torch._dynamo.config, str(limit_type), None)
            return result

        return watched_limit


_TAP = _DynamoTap()


# --- the ledger ---------------------------------------------------------------------------------


@dataclass
class EagerFallback:
    """A code object that hit its recompile limit without raising: new shapes now run eagerly."""

    code: CodeType
    limit_type: str
    hit_at_call: int  # the counted call during which the limit was hit (0: calls not counted)
    calls_since: int | None  # counted calls from that one on (None: calls not counted)

    @property
    def label(self) -> str:
        return code_label(self.code)


@dataclass(eq=False)
class CompileLedger:
    """Counts compiles per code object, recompile reasons, graph breaks and silent eager fallbacks.

    Use as a context manager around the calls to watch; wrap the callables whose calls should be
    counted with `count_calls` (the runner and `compile_repeated_blocks` do this when handed a
    ledger).
    """

    events: list[CompileEvent] = field(default_factory=list)
    _calls: collections.Counter = field(default_factory=collections.Counter)
    _graph_breaks_at_start: dict[str, int] = field(default_factory=dict)
    _graph_breaks_at_stop: dict[str, int] | None = None
    _active: bool = False

    # context management -------------------------------------------------------------------------

    def __enter__(self) -> CompileLedger:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._active:
            raise RuntimeError("this CompileLedger is already watching")
        self._graph_breaks_at_start = dict(_graph_break_counter())
        self._graph_breaks_at_stop = None
        _TAP.attach(self)
        self._active = True

    def stop(self) -> None:
        if self._active:
            _TAP.detach(self)
            self._graph_breaks_at_stop = dict(_graph_break_counter())
            self._active = False

    # recording ----------------------------------------------------------------------------------

    def _record(self, attempt: _Attempt) -> None:
        error = attempt.error
        error_text = None
        if error is not None:
            # First line only: Dynamo's messages go on with hints and URLs.
            first_line = (str(error).strip().splitlines() or [""])[0]
            error_text = f"{type(error).__name__}: {first_line}"
        limit_type = attempt.limit_type
        if limit_type is None and error is not None and "recompile limit" in str(error).lower():
            limit_type = "recompile_limit"
        if limit_type is not None:
            kind: EventKind = "limit_hit"
        elif error is not None:
            kind = "failed"
        elif not attempt.produced:
            kind = "skipped"
        elif attempt.reasons is not None:
            kind = "recompile"
        else:
            kind = "compile"
        # Dynamo swallows the limit-hit Unsupported and runs the frame eagerly; only
        # FailOnRecompileLimitHit (fullgraph or fail_on_recompile_limit_hit) reaches the caller.
        raised = error is not None and not (kind == "limit_hit" and type(error).__name__ != "FailOnRecompileLimitHit")
        self.events.append(
            CompileEvent(
                code=attempt.code,
                kind=kind,
                reasons=attempt.reasons or (),
                limit_type=limit_type,
                limit_value=attempt.limit_value,
                error=error_text,
                raised=raised,
                calls_at_event=self._calls[attempt.code],
            )
        )

    def count_calls(self, fn: Callable[..., Any], *, target: Any = None) -> Callable[..., Any]:
        """Wrap `fn` so each call counts against `target`'s code object (default: `fn`'s)."""
        code = code_of(target if target is not None else fn)

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._calls[code] += 1
            return fn(*args, **kwargs)

        counted._parity_counted = fn  # type: ignore[attr-defined]
        return counted

    # queries ------------------------------------------------------------------------------------

    def _events_of(self, target: Any) -> list[CompileEvent]:
        if target is None:
            return list(self.events)
        code = code_of(target)
        return [event for event in self.events if event.code is code]

    def compiles(self, target: Any = None) -> int:
        """Frames compiled (first compiles and recompiles) for `target`'s code object, or for all."""
        return sum(event.kind in ("compile", "recompile") for event in self._events_of(target))

    def recompiles(self, target: Any = None) -> list[CompileEvent]:
        return [event for event in self._events_of(target) if event.kind == "recompile"]

    def recompile_reasons(self, target: Any = None) -> list[str]:
        """One text per recompile: its guard failures joined with ' | '."""
        return [" | ".join(event.reasons) for event in self.recompiles(target)]

    def limit_hits(self, target: Any = None) -> list[CompileEvent]:
        return [event for event in self._events_of(target) if event.kind == "limit_hit"]

    def calls(self, target: Any) -> int:
        return self._calls[code_of(target)]

    def codes(self) -> list[CodeType]:
        """Code objects seen (compiled, attempted or counted), in order of first appearance."""
        ordered: dict[CodeType, None] = {}
        for event in self.events:
            ordered.setdefault(event.code, None)
        for code in self._calls:
            ordered.setdefault(code, None)
        return list(ordered)

    def eager_fallbacks(self) -> list[EagerFallback]:
        """Code objects that hit the recompile limit silently, with the calls made since."""
        fallbacks = []
        for code in self.codes():
            silent = [e for e in self.limit_hits(code) if not e.raised]
            if not silent:
                continue
            first = silent[0]
            counted = code in self._calls
            # The call that hit the limit ran eagerly too, hence +1 over the count before it.
            since = self._calls[code] - first.calls_at_event + 1 if counted else None
            fallbacks.append(EagerFallback(code, first.limit_type or "recompile_limit", first.calls_at_event, since))
        return fallbacks

    def graph_breaks(self) -> dict[str, int]:
        """Graph-break reasons and counts since the ledger started (until it stopped)."""
        now = self._graph_breaks_at_stop if self._graph_breaks_at_stop is not None else _graph_break_counter()
        delta = {}
        for reason, count in now.items():
            extra = count - self._graph_breaks_at_start.get(reason, 0)
            if extra > 0:
                delta[reason] = extra
        return delta

    # report rows --------------------------------------------------------------------------------

    def expect_compiles(self, target: Any, expected: int, *, why: str) -> dict[str, Any]:
        """A judged row: `target` compiled exactly `expected` frames (`why` says where that number comes
        from); held to exactly that number, its `better` is `equal`."""
        code = code_of(target)
        observed = self.compiles(code)
        reasons = self.recompile_reasons(code)
        return {
            "metric": f"compiles[{code_label(code)}]",
            "value": observed,
            "threshold": expected,
            "verdict": "pass" if observed == expected else "fail",
            "detail": f"expected {expected} ({why}); {_reasons_detail(reasons)}",
            "better": "equal",  # exactly this many compiles
        }

    def rows(self) -> list[dict[str, Any]]:
        """Rows for the report: {metric, value, threshold, verdict, detail}.

        Counts carry `threshold`/`verdict` None (the suite knows what to expect, see
        `expect_compiles`); a recompile limit hit and an eager fallback are always `fail`.
        """
        rows: list[dict[str, Any]] = []
        fallbacks = {fb.code: fb for fb in self.eager_fallbacks()}
        for code in self.codes():
            label, where = code_label(code), code_location(code)
            reasons = self.recompile_reasons(code)
            rows.append(_row(f"compiles[{label}]", self.compiles(code), f"{where}; {_reasons_detail(reasons)}"))
            if reasons:
                rows.append(_row(f"recompiles[{label}]", len(reasons), " || ".join(reasons)))
            if code in self._calls:
                rows.append(_row(f"calls[{label}]", self._calls[code], where))
            for hit in self.limit_hits(code):
                how = "raised to the caller" if hit.raised else "swallowed by Dynamo: new shapes run eagerly"
                last = " | ".join(hit.reasons) or "?"
                detail = f"{hit.limit_type}={hit.limit_value}, {how}; last guard failure: {last}"
                rows.append(_row(f"recompile_limit_hit[{label}]", 1, detail, 0, "fail"))
            if code in fallbacks:
                fb = fallbacks[code]
                value = fb.calls_since if fb.calls_since is not None else -1
                detail = (
                    f"{fb.limit_type} hit during call {fb.hit_at_call}; {value} calls from then on "
                    "got no compile, new shapes among them ran eagerly (-1: calls not counted)"
                )
                rows.append(_row(f"eager_fallback_calls[{label}]", value, detail, 0, "fail"))
        breaks = self.graph_breaks()
        detail = "; ".join(f"{count}x {reason}" for reason, count in breaks.items()) or "none"
        rows.append(_row("graph_breaks", sum(breaks.values()), detail))
        return rows


def _row(metric: str, value: Any, detail: str, threshold: Any = None, verdict: str | None = None) -> dict[str, Any]:
    return {"metric": metric, "value": value, "threshold": threshold, "verdict": verdict, "detail": detail}


def _reasons_detail(reasons: list[str]) -> str:
    return "recompile reasons: " + (" || ".join(reasons) if reasons else "none")


def _graph_break_counter() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


# --- suite helpers ------------------------------------------------------------------------------


@contextlib.contextmanager
def fail_on_recompile() -> Iterator[None]:
    """Inside, any recompile raises `torch._dynamo.exc.RecompileError` naming function and reasons.

    Uses `torch._dynamo.config.patch(error_on_recompile=True)` rather than
    `torch.compiler.set_stance("fail_on_recompile")`: the config patch is thread-local and undone
    on exit even if the body raises, and its error carries the guard-failure reasons; the stance
    is process-global. Both leave first compiles of new code objects alone.
    """
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


def reset_compile_state() -> None:
    """Forget every compiled frame, so one test's cache cannot hide another's compile.

    Two tests compiling the same code object share Dynamo's cache: whichever runs second sees
    no compile (the cache bleed of vllm-project/vllm-omni#7455). Also clears Dynamo's counters and restores
    the default compiler stance.
    """
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.compiler.set_stance("default")

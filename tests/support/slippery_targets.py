"""`--target` factories that slip past a check that only looks for members: a factory
that ends the process or hangs, one that leaves a non-daemon thread running (as engines' background
loops do), a router that returns None, the forms a router's result may or may not take
(docs/targets.md §7), and mask-keyed decode graph members that answer a key nobody declared or
refuse a declared one (docs/targets.md §3.2). tests/harness/test_check_target_contract.py and tests/harness/test_bad_inputs_targets.py use them."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

STOP = threading.Event()  # what the threads below wait for (a test that starts one in its process can end it)


def exits() -> Any:
    sys.exit(0)


def exits_hard() -> Any:
    os._exit(0)


def hangs() -> Any:
    threading.Event().wait()


def make_serving() -> Any:
    """The built-in serving target, imported when asked for: importing this module stays light, so a
    check's time limit is spent in the factory it names, not in loading models (the factory-hangs
    row waits a few seconds and must find the check in the factory)."""
    from serving_models.target import make_target

    return make_target()


def leaves_a_thread() -> Any:
    """The serving target, and an engine loop that never ends on a non-daemon thread."""
    threading.Thread(target=STOP.wait, name="engine-loop").start()
    return make_serving()


class WithRouter:
    """The built-in serving target with `router()` replaced."""

    def __init__(self, name: str, router: Callable[[], Any]) -> None:
        self._target = make_serving()
        self.name = name
        self.router = router

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def router_returns_none() -> WithRouter:
    return WithRouter("router-none", lambda: None)


def router_exits() -> WithRouter:
    return WithRouter("router-exits", lambda: sys.exit(3))


def router_hangs() -> WithRouter:
    return WithRouter("router-hangs", lambda: threading.Event().wait())


class Reshaped:
    """The serving router whose `select_experts` result is handed back in another form."""

    def __init__(self, form: Callable[[Any], Any]) -> None:
        self._router = make_serving().router()
        self._form = form
        self.name = f"serving-{form.__name__}"

    def select_experts(self, logits: torch.Tensor, k: int, **options: Any) -> Any:
        return self._form(self._router.select_experts(logits, k, **options))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._router, name)


def plain(result: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/targets.md §7's plain pair, as vLLM's `select_experts` returns it."""
    return result.weights, result.ids


def named(result: Any) -> Any:
    """The built-in router's own NamedTuple `RoutingResult(weights, ids)`."""
    return result


class IdsFirst(NamedTuple):
    ids: torch.Tensor
    weights: torch.Tensor


def named_ids_first(result: Any) -> IdsFirst:
    """A NamedTuple that names its fields right but puts ids first (a consumer unpacking by
    position gets ids as weights: ROCm/ATOM's swapped pair, docs/routing.md §1)."""
    return IdsFirst(result.ids, result.weights)


@dataclasses.dataclass
class RoutingOutput:
    weights: torch.Tensor
    ids: torch.Tensor


def dataclass_result(result: Any) -> RoutingOutput:
    """An object with `.weights` and `.ids` that is not a pair: fused MoE cannot unpack it."""
    return RoutingOutput(result.weights, result.ids)


FORMS: dict[str, Callable[[Any], Any]] = {f.__name__: f for f in (plain, named, named_ids_first, dataclass_result)}


def router_form(form: str) -> WithRouter:
    return WithRouter(f"serving-{form}", lambda: Reshaped(FORMS[form]))


def router_plain() -> WithRouter:
    return router_form("plain")


def router_named() -> WithRouter:
    return router_form("named")


def router_named_ids_first() -> WithRouter:
    return router_form("named_ids_first")


def router_dataclass() -> WithRouter:
    return router_form("dataclass_result")


def forks() -> Any:
    """A factory that forks the process with a plain `os.fork`: both copies return the target. The
    copy's pid goes to $PARITY_TEST_FORK_PIDS when set (a test checks it is left running nowhere)."""
    copy = os.fork()
    if copy and os.environ.get("PARITY_TEST_FORK_PIDS"):
        with open(os.environ["PARITY_TEST_FORK_PIDS"], "a") as pids:
            pids.write(f"{copy}\n")
    return make_serving()


def signals_parent() -> Any:
    """A factory that sends SIGTERM to the process that started it."""
    import signal

    os.kill(os.getppid(), signal.SIGTERM)
    return make_serving()


def spawns_a_worker() -> Any:
    """A factory that starts an engine worker the way engines do (multiprocessing, fork start
    method): a process of its own that never returns into the caller. Not a copy of the harness."""
    import multiprocessing

    worker = multiprocessing.get_context("fork").Process(target=STOP.wait, args=(0.1,), daemon=True)
    worker.start()
    worker.join()
    return make_serving()


def router_attribute() -> WithRouter:
    """`router` set to the router adapter itself, not a method returning it."""
    target = WithRouter("router-attribute", lambda: None)
    target.router = make_serving().router()
    return target


class WithDecodeGraphs:
    """The built-in serving target whose AR adapters have mask-keyed decode graph members replaced
    (docs/targets.md §3.2); each replacement is called with the adapter and returns the member."""

    def __init__(self, name: str, **members: Callable[[Any], Any]) -> None:
        self._target = make_serving()
        self.name = name
        self._members = members

    def _patched(self, adapter: Any) -> Any:
        for member, make in self._members.items():
            setattr(adapter, member, make(adapter))
        return adapter

    def load_ar(self, *args: Any) -> Any:
        return self._patched(self._target.load_ar(*args))

    def build_ar(self, *args: Any) -> Any:
        return self._patched(self._target.build_ar(*args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def graph_key_not_declared() -> WithDecodeGraphs:
    """`decode_graph_key` answers "both", a key `decode_graph_keys` does not list (the suites found
    no graph for it: a bare `KeyError: 'both'`, before check-target asked)."""
    return WithDecodeGraphs("graph-key-not-declared", decode_graph_key=lambda adapter: lambda generating: "both")


def graph_select_refuses() -> WithDecodeGraphs:
    """`select_decode_graph` refuses a key `decode_graph_keys` declares."""

    def select(adapter: Any) -> Callable[[str | None], None]:
        original = adapter.select_decode_graph

        def select_decode_graph(key: str | None) -> None:
            if key == "gen_only":
                raise ValueError("no gen-only graph in this build")
            original(key)

        return select_decode_graph

    return WithDecodeGraphs("graph-select-refuses", select_decode_graph=select)

"""A standalone repro of the stage a chain blamed: both sides' stage computation, inputs and weights.

`write_repro` re-runs each side once, eagerly, catching the full call of the blamed stage's
computation: the declared module itself for an output tap, the module around it for an input tap
(the attention module computes o_proj's input), the function for a `Call`. It writes, under
`repro/<case>/` in the run directory:

* `weights.safetensors`: the parameters and buffers of every module the calls hold,
* `inputs.safetensors`: every tensor of the calls' arguments,
* `calls.json`: the calls' structure, each tensor a key into those files, each module its class's
  import path with its plain attributes and children (`parity.localise.calls_json`: the model
  packages must be importable where the repro runs; no pickle, so reading it runs no code of its own),
* `repro.py`: `python repro.py` rebuilds both calls, runs them, and prints both outputs, their
  error and the bound an fp64 run of the reference's side gives (`parity.localise.replay`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from parity.localise.calls_json import encode
from parity.localise.chain import Chain
from parity.localise.observe import Resolved
from parity.localise.stages import Call, Tap, Where
from parity.report import RUN_INFO_FILE

FORMAT = 3  # 3: calls.json (2 and 1 were pickles: refused); 2: every call of a function stage
CALLS_FILE, INPUTS_FILE, WEIGHTS_FILE, SCRIPT_FILE = "calls.json", "inputs.safetensors", "weights.safetensors", "repro.py"
PICKLE_FILE = "calls.pt"  # what formats 1 and 2 wrote: never read


@dataclass(frozen=True)
class StageSource:
    """One side, as the localiser ran it: its root module, its bound stage map and how to run the case."""

    root: nn.Module | None
    resolved: Resolved
    run: Callable[[], Any]


@dataclass
class CapturedCall:
    """The blamed stage's computation on one side: what to call, with what, and what to read."""

    fn: Any  # an nn.Module, or a "package.module:function" spec
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]]  # a module's last call; every call of a function (a per-row function's)
    read: dict[str, Any]  # how the stage's value comes out: {"output": i | None, "child": path | None, "layout", "split", "part"}


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, nn.Module):
        return value  # a module argument (an expert handed to the dispatch) is saved with its weights
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _clone(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init})
    return value


def _computing_module(root: nn.Module, where: Tap) -> tuple[str, str | None] | None:
    """(path of the module to run, path of the child whose input is the stage) for a Tap."""
    if not where.input:
        return where.path, None
    parts = where.path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:cut])
        module = root.get_submodule(parent)
        if type(module).forward is not nn.Module.forward and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return parent, ".".join(parts[cut:])
    return None


@contextlib.contextmanager
def _catching(root: nn.Module | None, where: Where) -> Iterator[dict[str, Any]]:
    """Catch the stage's computation while inside: a module's last call, every call of a function
    (the harness stacks a function's calls into one value, so the repro replays them all)."""
    caught: dict[str, Any] = {}
    if isinstance(where, Call):
        module_name, _, name = where.function.partition(":")
        owner = importlib.import_module(module_name)
        original = getattr(owner, name)

        def recorder(*args: Any, **kwargs: Any) -> Any:
            caught.setdefault("calls", []).append((_clone(args), _clone(kwargs)))
            caught.update(fn=where.function, child=None)
            return original(*args, **kwargs)

        setattr(owner, name, recorder)
        try:
            yield caught
        finally:
            setattr(owner, name, original)
        return
    assert root is not None
    located = _computing_module(root, where)
    if located is None:
        yield caught
        return
    path, child = located
    module = root.get_submodule(path)

    def pre_hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        caught.update(fn=module, calls=[(_clone(args), _clone(kwargs))], child=child, path=path)

    handle = module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield caught
    finally:
        handle.remove()


def capture(source: StageSource, site: str) -> CapturedCall | str:
    """Run the side once and catch the blamed site's computation (a reason string if it cannot)."""
    declarations = source.resolved.sites.get(site)
    if not declarations:
        return f"{site} is not declared on this side"
    for where in declarations:
        with _catching(source.root, where) as caught, torch.no_grad():
            source.run()
        if caught:
            read = {"output": where.output, "input": where.input, "child": caught["child"], "layout": where.layout}
            read.update(split=list(where.split), part=where.part)
            return CapturedCall(caught["fn"], caught["calls"], read)
    return f"no declaration of {site} ran ({', '.join(w.path for w in declarations)})"


def case_directory(case: str, mode: str) -> str:
    """`repro/<case>-<mode>`, spelt for any file system."""
    return "repro/" + re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{case}-{mode}")


REPRO_PY = '''"""Repro of {case} ({mode}): stage {site}.

{summary}

Written by parity; run `python repro.py` (add `--device cuda` to run on a GPU). It needs parity and
the model packages importable, nothing else: the inputs and weights are in this directory.
"""

from pathlib import Path

from parity.localise.replay import main

if __name__ == "__main__":
    main(Path(__file__).resolve().parent)
'''


def write_repro(run_dir: Path, chain: Chain, *, case: str, mode: str, target: StageSource, reference: StageSource) -> str:
    """Write the blamed stage's repro under `run_dir`; its path relative to `run_dir`, or "" and
    why not (the reason goes into the chain's row detail)."""
    blamed = chain.blamed
    if blamed is None:
        return ""
    calls = {}
    for side, source in (("target", target), ("reference", reference)):
        try:
            caught = capture(source, blamed.site)
        except Exception as exc:
            caught = f"re-running it raised {type(exc).__name__}: {str(exc)[:200]}"
        if isinstance(caught, str):
            return f"(no repro: {side}: {caught})"
        calls[side] = caught
    relative = case_directory(case, mode)
    directory = run_dir / relative
    try:
        _write(directory, chain, calls, case=case, mode=mode)
    except Exception as exc:  # the chain's rows matter more than the repro: say why and carry on
        shutil.rmtree(directory, ignore_errors=True)
        return f"(no repro: {type(exc).__name__}: {str(exc)[:300]})"
    return f"{relative}/repro.py"


def _write(directory: Path, chain: Chain, calls: dict[str, CapturedCall], *, case: str, mode: str) -> None:
    blamed = chain.blamed
    assert blamed is not None
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    skeleton: dict[str, Any] = {"format": FORMAT, "site": blamed.site, "case": case, "mode": mode, "summary": chain.summary()}
    skeleton["target_spec"] = _target_spec(directory.parent.parent)
    for side, call in calls.items():
        call.read["widths"] = [chain.widths.get(part) for part in call.read["split"]]
        skeleton[side] = {
            "fn": encode(call.fn, tensors, weights, f"{side}.fn") if isinstance(call.fn, nn.Module) else {"$function": call.fn},
            "calls": [
                {
                    "args": encode(tuple(args), tensors, weights, f"{side}.{i}.args"),
                    "kwargs": encode(dict(kwargs), tensors, weights, f"{side}.{i}.kwargs"),
                }
                for i, (args, kwargs) in enumerate(call.calls)
            ],
            "read": call.read,
        }
    text = json.dumps(skeleton, indent=1)  # before any file: a call it cannot hold leaves no partial repro
    save_file(_unshared(tensors), directory / INPUTS_FILE)
    save_file(_unshared(weights), directory / WEIGHTS_FILE)
    (directory / CALLS_FILE).write_text(text)
    (directory / SCRIPT_FILE).write_text(REPRO_PY.format(case=case, mode=mode, site=blamed.site, summary=chain.summary()))


def _target_spec(run_dir: Path) -> str:
    """The run's `--parity-target` (run.json): the repro loads it first, as the run did, so a target
    that changes code when it loads (a mutant's patch, an engine's registration) is reproduced too."""
    try:
        return str(json.loads((run_dir / RUN_INFO_FILE).read_text()).get("target", ""))
    except (OSError, ValueError):
        return ""


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage (a tied weight): give each its own."""
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        out[key] = tensor.clone() if pointer in seen and tensor.numel() else tensor
        seen.add(pointer)
    return out

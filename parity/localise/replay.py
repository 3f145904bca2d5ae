"""Running a repro directory (`parity.localise.repro`): both sides' stage, their error and its bound.

`python repro.py` in the directory, or `python -m parity.localise.replay DIR`. The reference's call
run again in float64 is the golden, so the bound is the suites' own: the target may be at most the
noise-floor multiplier times as far from it as the reference in its dtype is, plus the golden's
rounding (`parity.compare.golden_noise_rule`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from parity.compare import golden_noise_rule
from parity.localise.repro import FORMAT, ModuleRef, TensorRef


def _restore(
    value: Any, tensors: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor], device: str, dtype: torch.dtype | None
) -> Any:
    if isinstance(value, TensorRef):
        tensor = tensors[value.key].to(device)
        return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    if isinstance(value, ModuleRef):
        state = {k.removeprefix(value.prefix): v for k, v in weights.items() if k.startswith(value.prefix)}
        module = value.module
        if dtype is not None:
            module = module.to(dtype)
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        module.load_state_dict(state, strict=True, assign=True)
        return module.to(device).eval()
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_restore(v, tensors, weights, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _restore(v, tensors, weights, device, dtype) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value,
            **{
                f.name: _restore(getattr(value, f.name), tensors, weights, device, dtype)
                for f in dataclasses.fields(value)
                if f.init
            },
        )
    return value


def _callable(fn: Any) -> Any:
    if isinstance(fn, str):
        module_name, _, name = fn.partition(":")
        return getattr(importlib.import_module(module_name), name)
    return fn


def run_side(
    side: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor],
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One side's stage value: its calls rebuilt (cast to `dtype` if given), run, and read as the
    harness read them (the output, one element of it, or a child's input; the fused part), several
    calls stacked as the harness stacks them."""
    fn = _callable(_restore(side["fn"], tensors, weights, device, dtype))
    values = [
        _read(
            fn,
            _restore(call["args"], tensors, weights, device, dtype),
            _restore(call["kwargs"], tensors, weights, device, dtype),
            side["read"],
        )
        for call in side["calls"]
    ]
    if len(values) == 1:
        return values[0]
    return torch.cat([v.reshape(1, *v.shape) if v.dim() <= 1 else v for v in values])


def _read(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], read: Mapping[str, Any]) -> torch.Tensor:
    seen: list[Any] = []
    handle = None
    if read.get("child"):
        handle = fn.get_submodule(read["child"]).register_forward_hook(lambda _m, a, _o: seen.append(a[0]))
    try:
        with torch.no_grad():
            output = fn(*args, **kwargs)
    finally:
        if handle is not None:
            handle.remove()
    if read.get("child"):
        value = seen[-1]
    elif read.get("input"):
        value = args[0]
    else:
        value = output[read["output"]] if read.get("output") is not None and isinstance(output, (tuple, list)) else output
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if read.get("layout") == "heads_first":
        b, h, length, d = value.shape
        value = value.transpose(1, 2).reshape(b, length, h * d)
    elif read.get("layout") == "heads":
        value = value.flatten(-2)
    if read.get("split"):
        value = value.split(read["widths"], dim=-1)[read["split"].index(read["part"])]
    return value


def load_target(spec: str) -> str:
    """Load the run's target as the run did (its factory may patch code the calls run); a line
    saying what happened when it cannot be loaded here."""
    if not spec:
        return ""
    from parity.target import TargetError, resolve_target

    try:
        resolve_target(spec, "the run's --parity-target")
    except TargetError as exc:
        return f"note: {exc}; the calls run without what that target changes when it loads"
    return ""


def replay(directory: Path, *, device: str = "cpu") -> dict[str, Any]:
    """Both sides' stage values, the error between them and the bound (as numbers)."""
    skeleton = torch.load(directory / "calls.pt", weights_only=False)
    if skeleton.get("format") != FORMAT:
        raise ValueError(f"{directory / 'calls.pt'}: repro format {skeleton.get('format')!r}, this parity reads {FORMAT}")
    note = load_target(skeleton.get("target_spec", ""))
    tensors, weights = load_file(directory / "inputs.safetensors"), load_file(directory / "weights.safetensors")
    target = run_side(skeleton["target"], tensors, weights, device=device)
    reference = run_side(skeleton["reference"], tensors, weights, device=device)
    golden = run_side(skeleton["reference"], tensors, weights, device=device, dtype=torch.float64)
    width = reference.shape[-1] if reference.dim() else 1
    rows = [t.reshape(-1, width) if t.numel() % width == 0 else t.reshape(1, -1) for t in (golden, reference, target)]
    out: dict[str, Any] = {
        "site": skeleton["site"],
        "case": skeleton["case"],
        "mode": skeleton["mode"],
        "target": target,
        "reference": reference,
        "note": note,
    }
    if rows[2].shape != rows[1].shape:
        out["problem"] = f"the sides' values do not line up: target {tuple(target.shape)}, reference {tuple(reference.shape)}"
        return out
    if not reference.is_floating_point():
        out["mismatches"] = int((rows[2] != rows[1].to(rows[2].dtype)).sum())
        return out
    verdict, _ = golden_noise_rule(rows[0], rows[1], rows[2].to(rows[1].dtype), name=skeleton["site"])
    out.update(
        rmse=verdict.value,
        bound=verdict.threshold,
        diverged=not verdict.ok,
        max_abs=float((rows[2].double() - rows[1].double()).abs().max()),
    )
    return out


def _show(name: str, value: torch.Tensor) -> str:
    flat = value.detach().double().reshape(-1)
    head = ", ".join(f"{x:.6g}" for x in flat[:6].tolist())
    return (
        f"{name:>9}: {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} [{head}{', ...' if flat.numel() > 6 else ''}]"
    )


def main(directory: Path | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run a parity stage repro: both sides' outputs and their error.")
    if directory is None:
        parser.add_argument("directory", type=Path)
    parser.add_argument("--device", default="cpu", help="where to run both sides (default: cpu)")
    options = parser.parse_args()
    directory = directory or options.directory
    start = time.perf_counter()
    result = replay(directory, device=options.device)
    print(f"{result['case']} ({result['mode']}): stage {result['site']}")
    if result.get("note"):
        print(result["note"])
    print(_show("target", result["target"]))
    print(_show("reference", result["reference"]))
    if "problem" in result:
        print(result["problem"])
    elif "mismatches" in result:
        print(f"entries differing: {result['mismatches']} (an exact stage must have none)")
    else:
        state = "DIVERGED" if result["diverged"] else "within bound"
        print(
            f"rmse vs fp64 golden: {result['rmse']:.4g} (bound {result['bound']:.4g}): {state}; max |target - reference| {result['max_abs']:.4g}"
        )
    print(f"({time.perf_counter() - start:.2f} s)")


if __name__ == "__main__":
    main()

"""Running a repro directory (`parity.localise.repro`): both sides' stage, their error and its bound.

`python repro.py` in the directory, or `python -m parity.localise.replay DIR`. The reference's call
run again in float64 is the golden, so the bound is the suites' own: the target may be at most the
noise-floor multiplier times as far from it as the reference in its dtype is, plus the golden's
rounding (`parity.compare.golden_noise_rule`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from parity.compare import golden_noise_rule
from parity.localise.calls_json import Decoder, MissingPackage, ReproError, resolve_name
from parity.localise.repro import CALLS_FILE, FORMAT, INPUTS_FILE, PICKLE_FILE, WEIGHTS_FILE
from parity.observe.origin import origin_of

AGAIN = "write it again: re-run the failing case with `parity run` (its repro is rewritten under the new run directory)"


def run_side(side: Mapping[str, Any], decoder: Decoder, *, name: str) -> torch.Tensor:
    """One side's stage value: its calls rebuilt (cast to the decoder's dtype if given), run, and
    read as the harness read them (the output, one element of it, or a child's input; the fused
    part), several calls stacked as the harness stacks them."""
    fn_data = side["fn"]
    fn = (
        decoder.function(str(fn_data["$function"]))
        if isinstance(fn_data, dict) and "$function" in fn_data
        else decoder.value(fn_data)
    )
    calls = [(decoder.value(call["args"]), decoder.value(call["kwargs"])) for call in side["calls"]]
    values = []
    for args, kwargs in calls:
        try:
            values.append(_read(fn, tuple(args), dict(kwargs), side["read"]))
        except ReproError:
            raise
        except Exception as exc:  # the side's own code raised: where, in one line
            raise ReproError(
                f"the {name}'s call raised {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}{origin_of(exc)}"
            ) from None
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


def packages_of(spec: str) -> tuple[str, ...]:
    """The top-level packages whose functions a repro may call: the built-in model packages and
    the run's target's (docs/localise.md §5)."""
    from parity.target import BUILTIN_TARGETS

    found = [path.partition(".")[0] for path in BUILTIN_TARGETS.values()]
    module = BUILTIN_TARGETS.get(spec, spec).partition(":")[0]
    if module and module.partition(".")[0] != "parity":
        found.append(module.partition(".")[0])
    return tuple(dict.fromkeys(found))


def load_target(spec: str) -> str:
    """Load the run's target as the run did (its factory may patch code the calls run); a line
    saying what happened when it cannot be loaded here. A spec that names the standard library or
    torch is refused: a repro never calls into them."""
    if not spec:
        return ""
    from parity.target import BUILTIN_TARGETS, TargetError, resolve_target

    factory = BUILTIN_TARGETS.get(spec, spec)
    try:
        resolve_name(factory, packages_of(spec), kind="factory")
    except MissingPackage as exc:
        return (
            f"note: the run's target {spec} is not importable here ({exc}); the calls run without what it changes when it loads"
        )
    except ReproError as exc:
        raise ReproError(f"the run's target {spec!r}: {exc}") from None
    try:
        resolve_target(spec, "the run's --parity-target")
    except TargetError as exc:
        return f"note: {exc}; the calls run without what that target changes when it loads"
    return ""


def read_repro(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """calls.json and the two tensor files, or a `ReproError` saying what is wrong and what to do.
    A pickle in the directory (what parity wrote before format 3, or planted) is refused unread."""
    if not directory.is_dir():
        raise ReproError(f"{directory} is not a directory: give the repro's directory (the one holding {CALLS_FILE})")
    if (directory / PICKLE_FILE).exists():
        raise ReproError(
            f"{directory / PICKLE_FILE} is a pickle, which parity never loads (loading one can run any code); "
            f"this repro was written by an older parity or the file was planted: delete it, or {AGAIN}"
        )
    missing = [name for name in (CALLS_FILE, INPUTS_FILE, WEIGHTS_FILE) if not (directory / name).is_file()]
    if missing:
        raise ReproError(
            f"{directory} lacks {', '.join(missing)}: not a whole repro (copied in part?); copy the whole directory, or {AGAIN}"
        )
    try:
        skeleton = json.loads((directory / CALLS_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ReproError(f"{directory / CALLS_FILE} is not readable JSON ({exc}): the file is damaged; {AGAIN}") from None
    if not isinstance(skeleton, dict) or skeleton.get("format") != FORMAT:
        found = skeleton.get("format") if isinstance(skeleton, dict) else type(skeleton).__name__
        raise ReproError(f"{directory / CALLS_FILE}: repro format {found!r}, this parity reads {FORMAT}; {AGAIN}")
    lacking = [key for key in ("site", "case", "mode", "target", "reference") if key not in skeleton]
    if lacking:
        raise ReproError(f"{directory / CALLS_FILE} lacks {', '.join(lacking)}: the file is damaged; {AGAIN}")
    files = []
    for name in (INPUTS_FILE, WEIGHTS_FILE):
        try:
            files.append(load_file(directory / name))
        except Exception as exc:  # safetensors' own error for a torn or foreign file
            raise ReproError(
                f"{directory / name} is not a readable safetensors file ({str(exc)[:120]}): damaged; {AGAIN}"
            ) from None
    return skeleton, files[0], files[1]


def replay(directory: Path, *, device: str = "cpu") -> dict[str, Any]:
    """Both sides' stage values, the error between them and the bound (as numbers)."""
    skeleton, tensors, weights = read_repro(directory)
    spec = str(skeleton.get("target_spec", ""))
    note = load_target(spec)
    packages = packages_of(spec)
    try:
        target = run_side(skeleton["target"], Decoder(tensors, weights, packages=packages, device=device), name="target")
        reference = run_side(skeleton["reference"], Decoder(tensors, weights, packages=packages, device=device), name="reference")
        golden = run_side(
            skeleton["reference"],
            Decoder(tensors, weights, packages=packages, device=device, dtype=torch.float64),
            name="reference in fp64",
        )
    except MissingPackage as exc:
        where = f"the run's target is {spec}; " if spec else ""
        raise ReproError(
            f"{exc}: {where}install its package or put it on PYTHONPATH (PYTHONPATH=/path/to/its/root) where the repro runs, then run it again"
        ) from None
    except (KeyError, TypeError, AttributeError) as exc:  # a calls.json whose structure is not what this parity wrote
        raise ReproError(
            f"{directory / CALLS_FILE} does not hold a call as parity writes it ({type(exc).__name__}: {exc}); {AGAIN}"
        ) from None
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
    try:
        result = replay(directory, device=options.device)
    except ReproError as exc:  # one line, what is wrong and what to do (docs/localise.md §5)
        print(f"parity repro: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
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

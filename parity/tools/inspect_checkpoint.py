"""`parity inspect-checkpoint DIR`: what a checkpoint directory holds and whether both sides load it.

Per model family with a release layout (`reference_models.families.LAYOUTS`, keyed like
`parity.target.FAMILIES`): the recognised config (each field with the key it came
from, or the upstream default it fell back to), the keys the family keeps but ignores (with why),
and per implementation (the reference and the target) the tensor mapping: matched (read by the
implementation and present), unused (the family's tensors present but never read), missing (read
but absent). A tensor no family claims and a top-level key no family reads are listed too. Every
tensor is read once for values no model should run: a float8 tensor (quantised: its scales are
other tensors, the loaders refuse it) and any NaN or ±inf (an all-NaN tensor loads and makes every
output NaN). The result is not ok when a config contradicts itself, a tensor is flagged, or an
implementation cannot load the directory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

METADATA_KEYS = ("model_type", "architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path")
LIST_LIMIT = 8


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:LIST_LIMIT])
    return shown + (f", ... ({len(items) - LIST_LIMIT} more)" if len(items) > LIST_LIMIT else "")


def _groups(names: list[str]) -> str:
    counts: dict[str, int] = {}
    for name in names:
        prefix = ".".join(name.split(".")[:2]) + ".*"
        counts[prefix] = counts.get(prefix, 0) + 1
    return ", ".join(f"{prefix} ({count})" for prefix, count in counts.items())


@dataclasses.dataclass
class Inspection:
    lines: list[str]
    ok: bool

    def text(self) -> str:
        return "\n".join(self.lines)


def _mapping(label: str, adapter: Any, family_names: set[str], present: set[str]) -> list[str]:
    name_map = getattr(adapter, "weight_name_map", None)
    if name_map is None:  # the DiT loaders refuse a missing or an unexpected tensor: loading read them all
        read, how = set(family_names), " (every tensor: the loader refuses missing and unexpected ones)"
    else:
        read, how = {name for names in name_map().values() for name in names}, ""
    matched, missing = sorted(read & present), sorted(read - present)
    unused = sorted(family_names - read)
    lines = [f"    {label}: matched {len(matched)}, unused {len(unused)}, missing {len(missing)}{how}"]
    if unused:
        lines.append(f"      unused: {_groups(unused)}: {_names(unused)}")
    if missing:
        lines.append(f"      missing: {_names(missing)}")
    return lines


def tensor_problems(hf: Any, directory: Path) -> list[str]:
    """One line per tensor whose values no model should run: float8 (a quantised format whose
    scales live in other tensors) or holding NaN / ±inf. Reads each file once, one tensor at a time."""
    import torch

    weight_map, files, _ = hf.weight_files(directory)
    problems = []
    for filename in files:
        for name, tensor in hf.read_safetensors(directory / filename):
            if (weight_map and weight_map.get(name) != filename) or not tensor.is_floating_point():
                continue  # the loaders name those themselves (index disagreements, integer weights)
            if tensor.element_size() < 2:
                problems.append(
                    f"tensor {name}: dtype {tensor.dtype}: quantised float8, its scales are other tensors (the loaders refuse it)"
                )
                continue
            bad = tensor.numel() - int(torch.isfinite(tensor).sum())
            if bad:
                nans = int(torch.isnan(tensor).sum())
                what = (
                    f"all {tensor.numel()} values are NaN"
                    if nans == tensor.numel()
                    else f"{bad} of {tensor.numel()} values are NaN or ±inf"
                )
                problems.append(
                    f"tensor {name}: {what} (a broken conversion or an uninitialised buffer: every output would be NaN)"
                )
    return problems


def inspect_checkpoint(directory: str | Path, target_spec: str = "serving", device: str = "cpu") -> Inspection:
    import torch

    from parity.target import FAMILIES, TargetError, resolve_target
    from reference_models.common import hf_checkpoint as hf
    from reference_models.common import release_layout
    from reference_models.families import LAYOUTS as layouts

    reference = resolve_target("reference")
    directory = Path(directory)
    ok = True
    data = release_layout.read_config_json(directory)
    names = hf.tensor_names(directory)
    _, _, source = hf.weight_files(directory)
    layout = "release" if release_layout.is_release_config(data) else "parity"
    lines = [f"checkpoint {directory}: {layout} layout; {len(names)} tensors in {source}"]
    flagged = tensor_problems(hf, directory)
    if flagged:
        ok = False
        lines.append(f"tensors no model should run ({len(flagged)}):")
        lines += [f"  {problem}" for problem in flagged[:LIST_LIMIT]]
        if len(flagged) > LIST_LIMIT:
            lines.append(f"  ... ({len(flagged) - LIST_LIMIT} more)")
    claimed: set[str] = set()
    read_keys: set[str] = set()
    try:
        target = resolve_target(target_spec)
    except TargetError as exc:
        target, ok = None, False
        lines.append(f"target: {exc}")
    for key, family in layouts.items():
        record = FAMILIES[key]  # the one definition of the family: its name, the member that loads it
        own = {n: found for n in names if (found := family.local_name(n)) is not None}
        keys = [k for k in family.config_keys if k in data]
        if not own:  # a release DiT directory states the LLM's width in llm_config without holding the LLM
            lines.append(f"{key}: not in this checkpoint" + (f" (config keys {', '.join(keys)}, no tensors)" if keys else ""))
            continue
        read_keys.update(keys)
        claimed.update(own)
        lines.append(f"{key}: config from {', '.join(keys) or 'config.json'}")
        try:
            parsed = family.parse(data, str(directory / "config.json"))
        except ValueError as exc:
            ok = False
            lines.append(f"  config refused: {exc}")
            continue
        lines.append(f"  recognised ({len(parsed.recognised)}):")
        width = max(len(k) for k in parsed.recognised)
        for key, (value, where) in parsed.recognised.items():
            lines.append(f"    {key:<{width}} = {release_layout.describe_value(value):<24} from {where}")
        lines.append(f"  ignored ({len(parsed.ignored)}):")
        for path, value in parsed.ignored.items():
            lines.append(f"    {path} = {release_layout.describe_value(value, 40)}: {parsed.reasons.get(path, 'not read')}")
        used = {n for n, (local, _) in own.items() if local is not None}
        known = {n: reason for n, (local, reason) in own.items() if local is None}
        lines.append(f"  tensors: {len(used)} of this family, {len(known)} known and not used")
        for reason in sorted(set(known.values())):
            group = sorted(n for n, r in known.items() if r == reason)
            lines.append(f"    not used ({reason}): {_groups(group)}")
        ref_load = getattr(reference, record.loader)
        sides = [("reference", lambda d=directory, load=ref_load: load(d, device, torch.float32))]
        if target is not None:
            loader = getattr(target, record.loader, None)
            if loader is None:
                lines.append(f"    target {target_spec}: provides no {record.loader}: not inspected")
            else:
                sides.append((f"target {target_spec}", lambda d=directory, load=loader: load(d, device, torch.float32)))
        for label, load in sides:
            try:
                adapter = load()
            except Exception as exc:
                ok = False
                text = f"{type(exc).__name__}: {exc}".replace("\n", " | ")
                lines.append(f"    {label}: cannot load: {text[:600]}")
                continue
            lines += _mapping(label, adapter, used, set(names))
            decoder = getattr(adapter, "decoder", None)
            if decoder is not None:
                lines.append(f"      decodes with {type(decoder).__name__}")
    unclaimed = sorted(set(names) - claimed)
    if unclaimed:
        lines.append(f"tensors no family claims ({len(unclaimed)}): {_groups(unclaimed)}")
    unread = sorted(k for k in data if k not in read_keys and k not in METADATA_KEYS)
    if layout == "release" and unread:
        lines.append(f"top-level keys no family reads ({len(unread)}): {', '.join(unread)}")
    lines.append("ok: both implementations load every family present" if ok else "NOT OK: see the lines above")
    return Inspection(lines, ok)

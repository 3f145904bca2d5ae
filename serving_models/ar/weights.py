"""Checkpoint names <-> serving parameters for the AR backbone, and loading/saving through them.

The checkpoint carries upstream names (`model.layers.N.self_attn.q_proj.weight`, ...); the serving
module fuses q|k|v into `qkv_proj` and gate|up into `gate_up_proj` and sits under the top-level
prefix `ar.language_model.`. `SERVING_TO_CHECKPOINT` is the whole map as data: patterns in which
`*` stands for the same text on both sides, tried in order, first match wins; the checkpoint
names of a fused parameter are listed in the order they are stacked along dim 0. The harness's
coverage map reads `weight_name_map(module)`: every serving parameter with its checkpoint tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from serving_models.ar.config import MammothModa2ARConfig
from serving_models.ar.model import MammothModa2ForConditionalGeneration, MergedColumnLinear
from serving_models.common import safetensors_io

TOP_LEVEL_PREFIX = "ar.language_model."

SERVING_TO_CHECKPOINT: dict[str, list[str]] = {
    "ar.language_model.model.layers.*.self_attn.qkv_proj.weight": [
        "model.layers.*.self_attn.q_proj.weight",
        "model.layers.*.self_attn.k_proj.weight",
        "model.layers.*.self_attn.v_proj.weight",
    ],
    "ar.language_model.model.layers.*.self_attn.qkv_proj.bias": [
        "model.layers.*.self_attn.q_proj.bias",
        "model.layers.*.self_attn.k_proj.bias",
        "model.layers.*.self_attn.v_proj.bias",
    ],
    "ar.language_model.model.layers.*.mlp.gate_up_proj.weight": [
        "model.layers.*.mlp.gate_proj.weight",
        "model.layers.*.mlp.up_proj.weight",
    ],
    "ar.language_model.model.layers.*.gen_mlp.gate_up_proj.weight": [
        "model.layers.*.gen_mlp.gate_proj.weight",
        "model.layers.*.gen_mlp.up_proj.weight",
    ],
    "ar.language_model.*": ["*"],
}

_COMPILED = [(re.compile("^" + re.escape(k).replace(r"\*", "(.+)") + "$"), v) for k, v in SERVING_TO_CHECKPOINT.items()]


def checkpoint_names_for(serving_name: str) -> list[str]:
    """Checkpoint tensors behind the top-level module's parameter `serving_name` (stacking order)."""
    for pattern, targets in _COMPILED:
        match = pattern.match(serving_name)
        if match:
            return [t.replace("*", match.group(1)) for t in targets]
    raise KeyError(f"serving parameter {serving_name!r} has no checkpoint name (not under {TOP_LEVEL_PREFIX!r})")


def _fused_owner(module: nn.Module, name: str) -> MergedColumnLinear | None:
    owner = module.get_submodule(name.rsplit(".", 1)[0])
    return owner if isinstance(owner, MergedColumnLinear) else None


# The release layout (a composite model's prefixed names): the engine's own table, first match
# wins; the vision tower and the other stages' tensors are not this model's.
NOT_THIS_MODEL = ("llm_model.model.visual.", "llm_model.visual.", "model.visual.", "visual.")
NOT_THIS_MODEL += ("gen_transformer.", "gen_vae.", "gen_image_condition_refiner.", "gen_tokenizer.")
RELEASE_PREFIXES = (
    ("llm_model.model.language_model.", "model."),
    ("llm_model.lm_head.", "lm_head."),
    ("llm_model.gen_head.", "gen_head."),
    ("llm_model.model.", "model."),
    ("model.language_model.", "model."),
)


PARITY_PREFIXES = ("model.", "lm_head.", "gen_head.")


def local_checkpoint_name(name: str, *, release: bool = False) -> str | None:
    """A file's tensor name -> the checkpoint name the map above uses; None for other models'
    tensors. In a release directory a name under no known prefix is no model's and is not read
    (docs/checkpoints.md §2); in parity's layout it is kept, so the load names it unexpected."""
    if name.startswith(NOT_THIS_MODEL):
        return None
    for prefix, local in RELEASE_PREFIXES:
        if name.startswith(prefix):
            return local + name[len(prefix) :]
    return None if release and not name.startswith(PARITY_PREFIXES) else name


def weight_name_map(module: nn.Module) -> dict[str, list[str]]:
    """Every parameter of the top-level `module` -> its checkpoint tensor names, as they are
    spelt in the directory it was loaded from (release names for a release directory)."""
    spelt = getattr(module, "checkpoint_file_names", {})
    return {name: [spelt.get(n, n) for n in checkpoint_names_for(name)] for name, _ in module.named_parameters()}


def expected_checkpoint_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape that `module` needs (fused parameters split by their output sizes)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in module.named_parameters():
        parts = checkpoint_names_for(name)
        owner = _fused_owner(module, name)
        if owner is None:
            shapes[parts[0]] = tuple(param.shape)
        else:
            for part, rows in zip(parts, owner.output_sizes, strict=True):
                shapes[part] = (rows, *param.shape[1:])
    return shapes


def load_weights(
    module: nn.Module,
    checkpoint: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str,
    dtype: torch.dtype,
    source: str,
) -> None:
    """Adopt checkpoint tensors into `module` (built on meta), fusing as the map says."""
    tensors = dict(checkpoint)
    check_checkpoint(module, tensors, source)
    params = {}
    for name, _ in module.named_parameters():
        parts = [tensors[p].to(device=device, dtype=dtype) for p in checkpoint_names_for(name)]
        params[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    module.load_state_dict(params, strict=True, assign=True)


def check_checkpoint(module: nn.Module, tensors: Mapping[str, torch.Tensor], source: str) -> None:
    """Every tensor `module` needs is in `tensors` with its shape, nothing else is, all floating:
    one `WeightMismatchError` naming each missing, unexpected and misshapen tensor."""
    expected = expected_checkpoint_shapes(module)
    missing = [n for n in expected if n not in tensors]
    unexpected = [n for n in tensors if n not in expected]
    wrong = [
        (n, shape, tuple(tensors[n].shape)) for n, shape in expected.items() if n in tensors and tuple(tensors[n].shape) != shape
    ]
    if missing or unexpected or wrong:
        raise safetensors_io.WeightMismatchError(source, missing, unexpected, wrong)
    safetensors_io.check_floating(tensors, source)


def checkpoint_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's weights under checkpoint names (fused parameters split back)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        parts = checkpoint_names_for(name)
        owner = _fused_owner(module, name)
        pieces = [param.detach()] if owner is None else param.detach().split(owner.output_sizes, dim=0)
        out.update(zip(parts, pieces, strict=True))
    return out


def build_model(
    config: MammothModa2ARConfig | Mapping | object,
    checkpoint: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    source: str = "state dict",
) -> MammothModa2ForConditionalGeneration:
    """The top-level serving module with checkpoint-named weights, inference-only, in eval mode."""
    config = MammothModa2ARConfig.from_any(config)
    with torch.device("meta"):
        module = MammothModa2ForConditionalGeneration(config)
    items = checkpoint.items() if isinstance(checkpoint, Mapping) else checkpoint
    load_weights(module, items, device, dtype, source)
    return module.eval().requires_grad_(False)


def from_pretrained(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> MammothModa2ForConditionalGeneration:
    config = MammothModa2ARConfig.from_pretrained(directory)
    release = "llm_config" in safetensors_io.read_json_object(Path(directory) / "config.json")
    spelt: dict[str, str] = {}

    def local_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in safetensors_io.iterate_weights(directory, device):
            local = local_checkpoint_name(name, release=release)
            if local is not None:
                spelt[local] = name
                yield local, tensor

    module = build_model(config, local_weights(), device, dtype, source=str(directory))
    module.checkpoint_file_names = {k: v for k, v in spelt.items() if k != v}
    return module


def save_pretrained(
    module: MammothModa2ForConditionalGeneration, directory: str | Path, *, max_shard_bytes: int | None = None
) -> Path:
    directory = Path(directory)
    safetensors_io.write_weights(directory, checkpoint_state_dict(module), max_shard_bytes=max_shard_bytes)
    module.config.save(directory)
    return directory

"""The AR family's part of the release checkpoint layout (docs/checkpoints.md): tensor names, writing.

A release holds the AR backbone as the composite's LLM: its config is `llm_config` (a
Qwen2.5-VL-style config whose `text_config` carries the AR settings, read by
`reference_models.ar.config.parse_ar`), its tensors sit under `llm_model.` (the text model under
`model.language_model.` in transformers >= 4.52, directly under `model.` before; the vision tower,
which the AR family knows and does not use, under `model.visual.` or `visual.`). `LAYOUT` is the
family's `ReleaseLayout`, registered under the key "ar" in `reference_models/families.py`;
`load_ar` reads a parity or a release directory; `ar_release_config` / `release_state_dict` are
what `make-checkpoint --layout release` writes. Mirrors `reference_models/dit/release.py`: this
module imports the family's config and the shared layout vocabulary, never the registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from reference_models.ar.config import QWEN2_LLM, MammothModa2ARConfig, parse_ar
from reference_models.common import hf_checkpoint
from reference_models.common.release_layout import (
    CONFIG_FILE,
    ReleaseLayout,
    TensorRule,
    is_release_config,
    read_config_json,
)

# Release tensor prefixes of the AR family, first match wins (docs/checkpoints.md §2).
AR_RULES = (
    TensorRule("llm_model.model.language_model.", "model."),  # composite, transformers >= 4.52
    TensorRule("llm_model.model.visual.", None, "vision tower: image understanding is out of parity's scope"),
    TensorRule("llm_model.visual.", None, "vision tower: image understanding is out of parity's scope"),
    TensorRule("llm_model.lm_head.", "lm_head."),
    TensorRule("llm_model.gen_head.", "gen_head."),
    TensorRule("llm_model.model.", "model."),  # composite, transformers < 4.52
    TensorRule("model.language_model.", "model."),  # the LLM saved alone, transformers >= 4.52
    TensorRule("model.visual.", None, "vision tower: image understanding is out of parity's scope"),
    TensorRule("visual.", None, "vision tower: image understanding is out of parity's scope"),
    TensorRule("model.", "model."),  # the LLM alone before 4.52, and parity's own layout
    TensorRule("lm_head.", "lm_head."),
    TensorRule("gen_head.", "gen_head."),
)
# What make-checkpoint --layout release writes for each parity name prefix.
AR_WRITE_PREFIXES = {
    "model.": "llm_model.model.language_model.",
    "lm_head.": "llm_model.lm_head.",
    "gen_head.": "llm_model.gen_head.",
}


def release_name(name: str) -> str:
    """parity's AR tensor name -> the release name `make-checkpoint --layout release` writes."""
    for prefix, release in AR_WRITE_PREFIXES.items():
        if name.startswith(prefix):
            return release + name[len(prefix) :]
    raise KeyError(f"AR tensor {name!r} has no release prefix")


def load_ar(
    directory: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    *,
    others: Iterable[ReleaseLayout] = (),
) -> tuple[MammothModa2ARConfig, dict[str, torch.Tensor], dict[str, str]]:
    """(config, state dict under parity names, parity name -> name in the directory) of the AR in
    a parity or release directory. Tensors another family owns, or that the AR family knows and
    does not use (the vision tower), are not read; in a parity-layout directory a tensor no family
    knows is, and the model's shape check refuses it as unexpected (a release lists such tensors in
    `inspect-checkpoint` instead). `others`: the other families' layouts, whose tensors are not
    the AR's (`reference_models.families.others("ar")`; the reference adapter's `load` passes them
    through the model's `from_pretrained`)."""
    directory = Path(directory)
    config_data = read_config_json(directory)
    parsed = parse_ar(config_data, str(directory / CONFIG_FILE))
    release = is_release_config(config_data)
    names: dict[str, str] = {}
    for name in hf_checkpoint.tensor_names(directory):
        found = LAYOUT.local_name(name)
        if found is None and not release and not any(other.local_name(name) is not None for other in others):
            found = (name, "no family's: read, so the model's check names it unexpected")
        if found is not None and found[0] is not None:
            if found[0] in names:
                raise ValueError(f"{directory}: tensors {names[found[0]]} and {name} both map to {found[0]}")
            names[found[0]] = name
    wanted = set(names.values())
    tensors = hf_checkpoint.load_state_dict(directory, device=device, dtype=dtype, select=wanted.__contains__)
    local = {parity: tensors[name] for parity, name in names.items()}
    return parsed.config, local, names


# The vision tower's section of the llm_config a release carries (the models read none of it).
TINY_VISION_CONFIG = {"model_type": QWEN2_LLM, "depth": 1, "hidden_size": 16, "out_hidden_size": 64}


def ar_release_config(config: MammothModa2ARConfig) -> dict[str, Any]:
    """The `llm_config` a release writes for `config` (nested text config, M-RoPE sections, the
    keys upstream writes that the models ignore)."""
    text = dataclasses.asdict(config)
    llm_type = text.pop("model_type")
    half = config.head_dim // 2
    spatial = (half - half // 4) // 2
    sections = [half - 2 * spatial, spatial, spatial]  # [16, 24, 24] at head_dim 128, as the release
    text.update(
        model_type=f"{llm_type}_text",
        rope_scaling={"type": "mrope", "mrope_section": sections},
        max_position_embeddings=128000,
        use_sliding_window=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
    )
    llm = {
        "model_type": llm_type,
        "text_config": text,
        "vision_config": dict(TINY_VISION_CONFIG),
        "image_token_id": 151655,
        "video_token_id": 151656,
        "extra_gen_vocab": config.extra_gen_vocab,
        "gen_vocab_size": config.gen_vocab_size,
        "moe_type": config.moe_type,
    }
    return {"llm_config": llm}


def release_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An AR state dict under parity names -> the same tensors under the release names."""
    return {release_name(name): tensor for name, tensor in state.items()}


LAYOUT = ReleaseLayout(key="ar", config_keys=("llm_config",), parse=parse_ar, rules=AR_RULES)

"""The release checkpoint layout: its `config.json` as it is, its tensor names, per model family.

A released MammothModa2 directory (docs/checkpoints.md) holds one composite model:

* `config.json` is a `Mammothmoda2Config` (`model_type` "mammothmoda2"): `llm_config` is a
  Qwen2.5-VL-style config (`model_type` "mammothmoda2_qwen2_5_vl", or "mammothmoda2_qwen3_vl" for
  Dev) whose `text_config` carries the AR settings next to a `vision_config`; beside it sit the
  DiT's `gen_dit_config`, `gen_vae_config`, `gen_axes_dim_rope`, `gen_axes_lens`,
  `gen_condition_mode`, `gen_transport_config`;
* tensors are prefixed by the submodule that owns them: `llm_model.` (the VL model: its text model
  under `model.language_model.` in transformers >= 4.52, directly under `model.` before; the
  vision tower under `model.visual.` or `visual.`), `gen_transformer.` (the DiT), `gen_vae.`, ...;
* weights in `model.safetensors` or shards listed by an index (any `*.safetensors.index.json`).

Each model family registers a `ReleaseFamily` in `FAMILIES`: which config keys it reads (and how,
with upstream's defaults where a key is absent), which tensor prefixes are its and what they map
to, how the reference loads it and how `make-checkpoint --layout release` writes it. The AR family
is here; the DiT family registers its own entry (`FAMILIES["dit"]`). Keys no family reads are kept
and listed as ignored; only contradictions are refused (`ReleaseConfigError`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from reference_models.ar.config import MammothModa2ARConfig, ar_config
from reference_models.ar.config import value_problem as ar_value_problem
from reference_models.common import hf_checkpoint

RELEASE_MODEL_TYPE = "mammothmoda2"
QWEN2_LLM, QWEN3_LLM = "mammothmoda2_qwen2_5_vl", "mammothmoda2_qwen3_vl"
CONFIG_FILE = "config.json"


class ReleaseConfigError(ValueError):
    """A release config.json whose values contradict each other or what the models can run."""


@dataclasses.dataclass
class ParsedConfig:
    """One family's reading of a config.json: the config object, where each field came from, and
    the keys of its sections it does not use (path -> value)."""

    config: Any
    recognised: dict[str, tuple[Any, str]]  # field -> (value, source: a key path or "default ...")
    ignored: dict[str, Any]
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)  # ignored path -> why that is safe


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """A release tensor prefix: the family's own name prefix it maps to, or None when the family
    knows the tensors but does not use them (`reason` says why)."""

    release: str
    local: str | None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class ReleaseFamily:
    name: str
    target_loader: str  # the Target member that loads this family from a directory
    config_keys: tuple[str, ...]  # top-level keys of the release config.json this family reads
    parse: Callable[[Mapping[str, Any], str], ParsedConfig]
    rules: tuple[TensorRule, ...]
    reference_loader: Callable[[Path, Any, Any], Any]  # (directory, device, dtype) -> adapter
    write: Callable[[str, int], tuple[dict[str, Any], dict[str, torch.Tensor]]]  # (size, seed) -> (config keys, tensors)

    def local_name(self, name: str) -> tuple[str | None, str] | None:
        """(local name or None, reason) for a release tensor of this family; None if not its."""
        for rule in self.rules:
            if name.startswith(rule.release):
                local = None if rule.local is None else rule.local + name[len(rule.release) :]
                return local, rule.reason
        return None


FAMILIES: dict[str, ReleaseFamily] = {}


def is_release_config(data: Mapping[str, Any]) -> bool:
    return data.get("model_type") == RELEASE_MODEL_TYPE or "llm_config" in data


def read_config_json(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}")
    return hf_checkpoint.read_json_object(path)  # not UTF-8, not JSON, not an object: one line naming the file


# ---------------------------------------------------------------------------------------------
# The AR family: llm_config.text_config
# ---------------------------------------------------------------------------------------------

# Upstream's text-config defaults for a key the release leaves out (the classes' __init__ defaults:
# Mammothmoda2Qwen2_5_VLTextConfig and Mammothmoda2Qwen3VLTextConfig). `gen_vocab_start_index`
# None means "derived": vocab_size with extra_gen_vocab, vocab_size - gen_vocab_size without.
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    QWEN2_LLM: {
        "vocab_size": 152064,
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
        "extra_gen_vocab": True,
        "gen_vocab_size": 32800,
        "gen_vocab_start_index": None,
        "moe_type": "ffn",
    },
    QWEN3_LLM: {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 5_000_000.0,
        "tie_word_embeddings": False,
        "extra_gen_vocab": True,
        "gen_vocab_size": 32800,
        "gen_vocab_start_index": 152064,
        "moe_type": "ffn",
    },
}
# Keys of llm_config that upstream copies into text_config when text_config lacks them.
LLM_LEVEL_KEYS = ("extra_gen_vocab", "gen_vocab_size", "gen_vocab_start_index", "moe_type")
# text_config keys the models read neither way, each with why that is safe for parity's cases.
TEXT_IGNORED_REASONS = {
    "rope_scaling": "M-RoPE sections: text and gen rows carry equal t/h/w positions, so they reduce to 1-D RoPE",
    "max_position_embeddings": "a length limit, not a weight or an op",
    "attention_dropout": "training only",
    "initializer_range": "training only",
    "use_cache": "a generate() switch",
    "max_window_layers": "sliding window is off (use_sliding_window false)",
    "sliding_window": "sliding window is off (use_sliding_window false)",
    "use_sliding_window": "false: full attention on every layer",
    "layer_types": "every layer full_attention",
    "image_token_id": "image understanding placeholders: no vision input in parity's cases",
    "video_token_id": "video understanding placeholders: no vision input in parity's cases",
    "attention_bias": "the Qwen2.5 text path always has q/k/v biases, Qwen3 never",
    "head_dim": "equals hidden_size / num_attention_heads",
    "model_type": "the text config's own class name (llm_config.model_type selects the backbone)",
}


def _mrope_sections(rope_scaling: Any, head_dim: int, where: str) -> None:
    """Refuse an M-RoPE layout the 1-D reduction does not cover: sections must split head_dim / 2."""
    if rope_scaling is None:
        return
    if not isinstance(rope_scaling, Mapping):
        raise ReleaseConfigError(f"{where}.rope_scaling: expected an object, got {type(rope_scaling).__name__}")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ReleaseConfigError(
            f"{where}.rope_scaling.rope_type {kind!r}: only default / mrope RoPE is implemented (no scaled RoPE)"
        )
    sections = rope_scaling.get("mrope_section")
    if sections is not None and (not isinstance(sections, list) or sum(sections) != head_dim // 2):
        raise ReleaseConfigError(
            f"{where}.rope_scaling.mrope_section {sections!r} must be a list summing to head_dim / 2 = {head_dim // 2}"
        )


def _check_text_values(values: Mapping[str, Any], where_of: Mapping[str, str], source: str) -> None:
    """The release's text settings with the checks the flat layout applies (types, then values a
    model cannot run: zero sizes, a negative or NaN eps), one line naming the key path."""
    for key, value in values.items():
        if key not in where_of:
            continue  # upstream's default
        try:
            hf_checkpoint.check_field_types(MammothModa2ARConfig, {key: value}, source, prefix=f"{where_of[key]}.")
        except ValueError as exc:
            raise ReleaseConfigError(str(exc)) from None
        problem = ar_value_problem(key, value)
        if problem:
            raise ReleaseConfigError(f"{source}: key '{where_of[key]}.{key}': {problem}, found {type(value).__name__} {value!r}")


def parse_ar(data: Mapping[str, Any], source: str = CONFIG_FILE) -> ParsedConfig:
    """The AR config of a release config.json (or of parity's flat one, read as before)."""
    if not is_release_config(data):
        config = MammothModa2ARConfig.from_dict(dict(data), source=source)
        recognised = {f.name: (getattr(config, f.name), f.name) for f in dataclasses.fields(config)}
        return ParsedConfig(config, recognised, {})
    llm = data.get("llm_config")
    if not isinstance(llm, Mapping):
        raise ReleaseConfigError(f"{source}: a release config needs an llm_config object")
    llm_type = llm.get("model_type", QWEN2_LLM)
    if llm_type not in TEXT_DEFAULTS:
        raise ReleaseConfigError(f"{source}: llm_config.model_type {llm_type!r} is not one of {', '.join(TEXT_DEFAULTS)}")
    text = llm.get("text_config") or {}
    if not isinstance(text, Mapping):
        raise ReleaseConfigError(f"{source}: key 'llm_config.text_config': expected a JSON object, found {type(text).__name__}")
    # Before text_config existed (and for keys it lacks), the text settings sit on llm_config itself.
    where_of = dict.fromkeys(text, "llm_config.text_config")
    merged = dict(text)
    for key, value in llm.items():
        if key in ("text_config", "vision_config", "model_type") or key in merged:
            continue
        if key in TEXT_DEFAULTS[llm_type] or key in LLM_LEVEL_KEYS:
            merged[key], where_of[key] = value, "llm_config"
    # Upstream builds gen_head from llm_config's own gen_vocab_size and the gen table from
    # text_config's: two values that disagree are two shapes for one vocabulary.
    for key in ("gen_vocab_size", "extra_gen_vocab"):
        if key in llm and key in text and llm[key] != text[key]:
            raise ReleaseConfigError(
                f"{source}: llm_config.{key} = {llm[key]!r} contradicts llm_config.text_config.{key} = {text[key]!r}"
            )
    recognised: dict[str, tuple[Any, str]] = {}
    values: dict[str, Any] = {}
    defaults = TEXT_DEFAULTS[llm_type]
    for key, default in defaults.items():
        if key in merged:
            values[key], recognised[key] = merged[key], (merged[key], f"{where_of[key]}.{key}")
        else:
            values[key], recognised[key] = default, (default, f"default ({llm_type})")
    _check_text_values(values, where_of, source)  # before any arithmetic on them
    if values["gen_vocab_start_index"] is None:
        derived = values["vocab_size"] if values["extra_gen_vocab"] else values["vocab_size"] - values["gen_vocab_size"]
        values["gen_vocab_start_index"] = derived
        recognised["gen_vocab_start_index"] = (derived, "derived from vocab_size (upstream's rule)")
    values["model_type"] = llm_type
    recognised["model_type"] = (llm_type, "llm_config.model_type")
    head_dim = values["hidden_size"] // values["num_attention_heads"]
    _mrope_sections(merged.get("rope_scaling"), head_dim, f"{source}: {where_of.get('rope_scaling', 'llm_config')}")
    if merged.get("use_sliding_window"):
        raise ReleaseConfigError(f"{source}: use_sliding_window true: sliding-window attention is not implemented")
    kinds = set(merged.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ReleaseConfigError(f"{source}: layer_types {sorted(kinds)}: only full_attention layers are implemented")
    if "head_dim" in merged and merged["head_dim"] != head_dim:
        raise ReleaseConfigError(f"{source}: head_dim {merged['head_dim']} is not hidden_size / num_attention_heads = {head_dim}")
    try:
        config = MammothModa2ARConfig(**values)
    except ValueError as exc:
        raise ReleaseConfigError(f"{source}: {exc}") from exc
    ignored = {f"{where_of[k]}.{k}": v for k, v in merged.items() if k not in defaults}
    skip = ("text_config", "vision_config", "model_type")
    ignored.update({f"llm_config.{k}": v for k, v in llm.items() if k not in skip and k not in merged})
    reasons = {path: TEXT_IGNORED_REASONS.get(path.rsplit(".", 1)[-1], "not read by the AR models") for path in ignored}
    if "vision_config" in llm:
        ignored["llm_config.vision_config"] = llm["vision_config"]
        reasons["llm_config.vision_config"] = "the vision tower: image understanding is out of parity's scope"
    return ParsedConfig(config, recognised, ignored, reasons)


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
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> tuple[MammothModa2ARConfig, dict[str, torch.Tensor], dict[str, str]]:
    """(config, state dict under parity names, parity name -> name in the directory) of the AR in
    a parity or release directory. Tensors another family owns, or that the AR family knows and
    does not use (the vision tower), are not read; in a parity-layout directory a tensor no family
    knows is, and the model's shape check refuses it as unexpected (a release lists such tensors in
    `inspect-checkpoint` instead)."""
    directory = Path(directory)
    config_data = read_config_json(directory)
    parsed = parse_ar(config_data, str(directory / CONFIG_FILE))
    release = is_release_config(config_data)
    family = FAMILIES["ar"]
    names: dict[str, str] = {}
    for name in hf_checkpoint.tensor_names(directory):
        found = family.local_name(name)
        if found is None and not release and not any(other.local_name(name) is not None for other in FAMILIES.values()):
            found = (name, "no family's: read, so the model's check names it unexpected")
        if found is not None and found[0] is not None:
            if found[0] in names:
                raise ValueError(f"{directory}: tensors {names[found[0]]} and {name} both map to {found[0]}")
            names[found[0]] = name
    wanted = set(names.values())
    tensors = hf_checkpoint.load_state_dict(directory, device=device, dtype=dtype, select=wanted.__contains__)
    local = {parity: tensors[name] for parity, name in names.items()}
    return parsed.config, local, names


def _reference_ar(directory: Path, device: Any, dtype: Any) -> Any:
    from reference_models.ar.adapter import ReferenceARAdapter

    return ReferenceARAdapter.load(directory, device, dtype)


# ---------------------------------------------------------------------------------------------
# Writing a release-layout directory (make-checkpoint --layout release)
# ---------------------------------------------------------------------------------------------

# Sections a release config carries whatever families are written.
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


def _write_ar(size: str, seed: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from reference_models.checkpoints import random_state_dict

    config = ar_config(size)
    state = random_state_dict(config, seed, "cpu", torch.float32)
    return ar_release_config(config), {release_name(name): tensor for name, tensor in state.items()}


def write_release_checkpoint(
    families: tuple[str, ...], size: str, seed: int, out_dir: str | Path, *, max_shard_bytes: int | None = None
) -> Path:
    """A directory in the release layout holding `families` (each registered in `FAMILIES`)."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"no release layout registered for {unknown}; registered: {sorted(FAMILIES)}")
    config: dict[str, Any] = {"model_type": RELEASE_MODEL_TYPE, "architectures": ["Mammothmoda2Model"]}
    tensors: dict[str, torch.Tensor] = {}
    for name in families:
        keys, family_tensors = FAMILIES[name].write(size, seed)
        for key, value in keys.items():  # a section two families write (llm_config): the first one's stays
            config.setdefault(key, value)
        tensors.update(family_tensors)
    out_dir = Path(out_dir)
    hf_checkpoint.save_state_dict(out_dir, tensors, max_shard_bytes=max_shard_bytes)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


FAMILIES["ar"] = ReleaseFamily(
    name="ar",
    target_loader="load_ar",
    config_keys=("llm_config",),
    parse=parse_ar,
    rules=AR_RULES,
    reference_loader=_reference_ar,
    write=_write_ar,
)


# ---------------------------------------------------------------------------------------------
# The DiT family: gen_dit_config, gen_vae_config, gen_axes_*, the LLM width (reference_models/dit/release.py)
# ---------------------------------------------------------------------------------------------


def parse_dit(data: Mapping[str, Any], source: str = CONFIG_FILE) -> ParsedConfig:
    """The DiT config of a release config.json (docs/model.md §10), or of parity's flat DiT one."""
    from reference_models.dit import release as dit_release
    from reference_models.dit.config import DiTConfig

    if not dit_release.is_release_config(data):
        config = DiTConfig.from_json_dict(dict(data), source=source)
        fields = [f.name for f in dataclasses.fields(config) if f.name not in ("decoder", "name")]
        return ParsedConfig(config, {name: (getattr(config, name), name) for name in fields}, {})
    config, notes = dit_release.config_from_release(data, source)
    given = data.get("gen_dit_config") or {}
    recognised: dict[str, tuple[Any, str]] = {}
    for field in dataclasses.fields(config):
        if field.name in ("decoder", "name"):
            continue
        if field.name == "text_feat_dim" and dit_release._llm_width(data) is not None:
            where = "llm_config text width (the caption embedder is re-created for it)"
        elif field.name == "rope_theta":
            where = "hard-coded upstream"
        else:
            where = f"gen_dit_config.{field.name}" if field.name in given else "default (diffusers Transformer2DModel)"
        recognised[field.name] = (getattr(config, field.name), where)
    for name in ("latent_channels", "scaling_factor", "shift_factor"):
        source_key = "gen_vae_config." + name if name in (data.get("gen_vae_config") or {}) else "default"
        recognised[f"decoder.{name}"] = (getattr(config.decoder, name), source_key)
    paths = {key: key if key in data or key.startswith("gen_dit_config.") else f"gen_dit_config.{key}" for key in notes}
    ignored = {paths[key]: _lookup(data, paths[key]) for key in notes}
    return ParsedConfig(config, recognised, ignored, {paths[key]: reason for key, reason in notes.items()})


def _lookup(data: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted key path of a config ("gen_dit_config.axes_lens"), or of a top-level key."""
    if path in data:
        return data[path]
    value: Any = data
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _dit_rules() -> tuple[TensorRule, ...]:
    from reference_models.dit import release as dit_release

    unused = tuple(
        TensorRule(prefix, None, reason) for prefix, reason in dit_release.UNUSED_TENSORS if not prefix.startswith("llm_model.")
    )
    return (
        *unused,  # the more specific prefixes first: they sit under gen_transformer.
        TensorRule(dit_release.TRANSFORMER_PREFIX, ""),
        TensorRule(dit_release.DECODER_PREFIX, dit_release.DECODER_PREFIX, ""),
        # The release's VAE decodes (docs/model.md §10), unless parity's stand-in is present.
        TensorRule(dit_release.VAE_PREFIX, dit_release.VAE_PREFIX, ""),
    )


def _reference_dit(directory: Path, device: Any, dtype: Any) -> Any:
    from reference_models.dit.adapter import ReferenceDiT

    return ReferenceDiT.load(directory, device, dtype)


def _write_dit(size: str, seed: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from reference_models.dit import release as dit_release
    from reference_models.dit.checkpoint import random_state_dict
    from reference_models.dit.config import config_for_size

    config = config_for_size(size)
    state = random_state_dict(config, seed)
    keys = dit_release.release_config_dict(config)
    for name in ("model_type", "architectures"):
        keys.pop(name, None)
    return keys, dit_release.release_state_dict(config, state, seed)


FAMILIES["dit"] = ReleaseFamily(
    name="dit",
    target_loader="load_dit",
    config_keys=(
        "gen_dit_config",
        "gen_vae_config",
        "gen_axes_dim_rope",
        "gen_axes_lens",
        "parity_stand_in_decoder",
        "llm_config",
    ),
    parse=parse_dit,
    rules=_dit_rules(),
    reference_loader=_reference_dit,
    write=_write_dit,
)


def describe_value(value: Any, limit: int = 60) -> str:
    """A config value as one short line (long objects elided)."""
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    if isinstance(value, float) and math.isfinite(value):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

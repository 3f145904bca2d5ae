"""Configuration of the MammothModa2 AR backbone, with the upstream field names.

The field names are those of upstream's text config (`Mammothmoda2Qwen2_5_VLTextConfig`: Qwen2
fields plus `extra_gen_vocab`, `gen_vocab_size`, `gen_vocab_start_index`, `moe_type`), so a
`config.json` written here reads like upstream's and the other way round. `moe_enable` is
upstream's per-layer switch (docs/model.md §4): half-open, 0-based ranges and a substring test on the
layer type. Named configurations (docs/model.md §9): `ar_config("tiny")` for the CPU lane and
`ar_config("full")` with the Preview widths. `parse_ar` reads either form of a `config.json`: this
flat one, or a release's nested `llm_config.text_config` (with upstream's defaults for absent keys);
it lives beside the config class so that `from_pretrained` needs no module above this one.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reference_models.common import hf_checkpoint
from reference_models.common.release_layout import (
    CONFIG_FILE,
    ParsedConfig,
    ReleaseConfigError,
    is_release_config,
)

MOE_TYPES = ("none", "attention", "ffn", "ffn_attention")

# Keys HF writes into config.json that carry no model structure; accepted and ignored.
HF_METADATA_KEYS = frozenset({"architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path"})


@dataclass(frozen=True)
class MoERange:
    """A parsed `moe_type`: expert kind and the half-open layer range `[start, end)`."""

    kind: str
    start: int
    end: float  # math.inf when the string carries no range

    def enables(self, layer_type: str, layer_idx: int) -> bool:
        # Upstream: `layer_type in moe_type` (substring, so "ffn" matches "ffn_attention").
        return layer_type in self.kind and self.start <= layer_idx < self.end


def parse_moe_type(moe_type: str) -> MoERange:
    """Parse `"ffn-14:28"`, `"ffn"`, `"none"`, ... the way upstream does, with clear errors.

    Upstream splits once on "-" when the string contains ":" and asserts the type; every string
    upstream would crash on (or silently misread) raises a ValueError naming the string here.
    """
    if not isinstance(moe_type, str):
        raise ValueError(f"moe_type must be a string such as 'ffn-14:28', got {type(moe_type).__name__} {moe_type!r}")
    expected = f"one of {', '.join(MOE_TYPES)}, optionally followed by '-START:END' (half-open, 0-based)"
    if ":" in moe_type:
        parts = moe_type.split("-")
        if len(parts) != 2:
            raise ValueError(f"moe_type {moe_type!r} is not TYPE-START:END; expected {expected}")
        kind, layers = parts
        bounds = layers.split(":")
        if len(bounds) != 2 or not all(b.isdigit() for b in bounds):
            raise ValueError(f"moe_type {moe_type!r}: layer range {layers!r} is not START:END with non-negative integers")
        start, end = int(bounds[0]), int(bounds[1])
        if start > end:
            raise ValueError(f"moe_type {moe_type!r}: range start {start} is after end {end} (the range is [start, end))")
    else:
        kind, start, end = moe_type, 0, math.inf
    if kind not in MOE_TYPES:
        raise ValueError(f"moe_type {moe_type!r}: type {kind!r} is not {expected}")
    return MoERange(kind, start, end)


def moe_enable(moe_type: str, layer_type: str, layer_idx: int) -> bool:
    """Upstream's switch: does `moe_type` give layer `layer_idx` a gen expert of `layer_type`?"""
    return parse_moe_type(moe_type).enables(layer_type, layer_idx)


# Values no model can run (the types are `hf_checkpoint.check_field_types`' business): a size of
# zero, a negative, zero or NaN eps or theta. `value_problem` is applied to the flat config and to
# the release's (`parse_ar` below) alike, and again when the config is built.
POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")


def value_problem(name: str, value: Any) -> str | None:
    """What is wrong with `value` for AR config field `name` (None: nothing the models cannot run)."""
    if name in POSITIVE_INTS:
        return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else "expected a positive int"
    if name in POSITIVE_FLOATS:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        return None if ok else "expected a positive, finite float"
    if name == "gen_vocab_size":
        return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else "expected a positive int"
    if name == "gen_vocab_start_index":
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
        return None if ok else "expected an int or null"
    return None


@dataclass(frozen=True)
class MammothModa2ARConfig:
    """The AR backbone's text config (upstream field names, Qwen2.5 style)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    # Defaults are upstream's (Mammothmoda2Qwen2_5_VLTextConfig): a config.json that leaves a key out
    # means upstream's value, not ours (the named configurations below set every field).
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-5
    extra_gen_vocab: bool = True
    gen_vocab_size: int = 32800
    gen_vocab_start_index: int | None = None  # None: vocab_size (upstream derives it so)
    moe_type: str = "ffn"
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    model_type: str = "mammothmoda2_qwen2_5_vl"

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            problem = value_problem(name, value)
            if problem:
                raise ValueError(f"{name}: {problem}, found {type(value).__name__} {value!r}")
        if self.gen_vocab_start_index is None:
            derived = self.vocab_size if self.extra_gen_vocab else self.vocab_size - self.gen_vocab_size
            object.__setattr__(self, "gen_vocab_start_index", derived)
        parse_moe_type(self.moe_type)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.gen_vocab_start_index < 0:
            raise ValueError(f"gen_vocab_start_index {self.gen_vocab_start_index} must be non-negative")
        # The gen start need not be the text table's size (docs/model.md §3): Dev's text table has
        # 151936 rows and its gen ids start at 152064. Ids in between belong to neither table.
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (the AR experts are SwiGLU: 'silu')")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings must be false: lm_head and gen_head are untied (docs/model.md §2)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def logits_width(self) -> int:
        """`vocab_size + gen_vocab_size`; column `vocab_size + j` is token `start + j` (docs/model.md §2)."""
        return self.vocab_size + (self.gen_vocab_size if self.extra_gen_vocab else 0)

    def token_of_column(self, column: Any) -> Any:
        """The token id a logits column stands for: gen column `vocab_size + j` is `start + j`
        (the identity when the gen vocabulary starts right after the text table)."""
        if not self.extra_gen_vocab or self.gen_vocab_start_index == self.vocab_size:
            return column
        return column + (column >= self.vocab_size) * (self.gen_vocab_start_index - self.vocab_size)

    def moe_enabled(self, layer_type: str, layer_idx: int) -> bool:
        return moe_enable(self.moe_type, layer_type, layer_idx)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers that carry a gen FFN expert (`gen_mlp`)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.moe_enabled("ffn", i))

    def replace(self, **changes: Any) -> MammothModa2ARConfig:
        return dataclasses.replace(self, **changes)

    # ---- config.json ----
    def to_dict(self) -> dict[str, Any]:
        return {"architectures": ["MammothModa2ARForCausalLM"], **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> MammothModa2ARConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields - HF_METADATA_KEYS)
        if unknown:
            raise ValueError(f"{source}: unknown AR config keys {unknown}; known keys: {sorted(fields)}")
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"{source}: missing AR config keys {missing}")
        hf_checkpoint.check_field_types(cls, data, source)
        for name in fields & set(data):
            problem = value_problem(name, data[name])
            if problem:
                raise ValueError(f"{source}: key '{name}': {problem}, found {type(data[name]).__name__} {data[name]!r}")
        return cls(**{k: v for k, v in data.items() if k in fields})

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> MammothModa2ARConfig:
        """The AR config of a parity directory (flat, strict) or a release one (nested, read as
        `parse_ar` does)."""
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: no config.json (an HF-style checkpoint directory needs one)")
        return parse_ar(hf_checkpoint.read_json_object(path), str(path)).config


@dataclass(frozen=True)
class TokenLayout:
    """Special gen-vocabulary ids of a configuration (docs/model.md §3); None where unconfirmed."""

    eol: int
    eof: int
    image_start: int | None
    image_end: int | None
    visual_start: int | None
    visual_end: int | None  # inclusive


_CONFIGS: dict[str, MammothModa2ARConfig] = {
    # The CPU lane (docs/model.md §9).
    "tiny": MammothModa2ARConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        gen_vocab_size=64,
        gen_vocab_start_index=256,
        moe_type="ffn-2:4",
    ),
    # Preview (Qwen2.5-VL-7B widths, docs/model.md §9).
    "full": MammothModa2ARConfig(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        gen_vocab_size=32800,
        gen_vocab_start_index=152064,
        moe_type="ffn-14:28",
    ),
}

_LAYOUTS: dict[str, TokenLayout] = {
    "tiny": TokenLayout(eol=256, eof=257, image_start=262, image_end=263, visual_start=264, visual_end=319),
    # Offsets 0 and 1 are confirmed; image end 152071 is vllm-omni's hard-coded value; the rest unconfirmed.
    "full": TokenLayout(eol=152064, eof=152065, image_start=None, image_end=152071, visual_start=None, visual_end=None),
}


def ar_config(size: str) -> MammothModa2ARConfig:
    """The named AR configuration `size` ("tiny" or "full")."""
    try:
        return _CONFIGS[size]
    except KeyError:
        raise ValueError(f"unknown AR size {size!r}; known sizes: {sorted(_CONFIGS)}") from None


def token_layout(size: str) -> TokenLayout:
    """The special-token ids of the named configuration `size`."""
    try:
        return _LAYOUTS[size]
    except KeyError:
        raise ValueError(f"unknown AR size {size!r}; known sizes: {sorted(_LAYOUTS)}") from None


AR_SIZES = tuple(_CONFIGS)


# llm_config.model_type of a release: the Preview backbone (Qwen2.5-VL) and Dev (Qwen3-VL).
QWEN2_LLM, QWEN3_LLM = "mammothmoda2_qwen2_5_vl", "mammothmoda2_qwen3_vl"

# ---------------------------------------------------------------------------------------------
# The release's form: llm_config.text_config of a release config.json (docs/checkpoints.md)
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
        problem = value_problem(key, value)
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

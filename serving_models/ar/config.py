"""The serving port's view of the MammothModa2 AR config (same field names as upstream's text config).

A serving engine reads the checkpoint's `config.json` itself, so this module does not import the
reference; `MammothModa2ARConfig.from_any` also accepts any object or mapping with the upstream
field names (the harness hands over the reference's config for in-memory builds).
`moe_enable` is the engine's copy of upstream's per-layer switch: half-open, 0-based ranges and a
substring test on the layer type; invalid strings raise a ValueError naming the string.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving_models.common.safetensors_io import check_field_types, read_json_object

MOE_TYPES = ("none", "attention", "ffn", "ffn_attention")
HF_METADATA_KEYS = frozenset({"architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path"})
QWEN2_MODEL_TYPE = "mammothmoda2_qwen2_5_vl"
QWEN3_MODEL_TYPE = "mammothmoda2_qwen3_vl"


# Upstream's text-config defaults per backbone, for keys a release config.json leaves out.
RELEASE_DEFAULTS: dict[str, dict[str, Any]] = {
    QWEN2_MODEL_TYPE: {
        "vocab_size": 152064,
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "moe_type": "ffn",
    },
    QWEN3_MODEL_TYPE: {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5_000_000.0,
        "moe_type": "ffn",
        "gen_vocab_start_index": 152064,
    },
}
RELEASE_LLM_KEYS = ("extra_gen_vocab", "gen_vocab_size", "gen_vocab_start_index", "moe_type")


def moe_layer_range(moe_type: str) -> tuple[str, int, float]:
    """`"ffn-14:28"` -> ("ffn", 14, 28); `"ffn"` -> ("ffn", 0, inf). Raises ValueError when malformed."""
    if not isinstance(moe_type, str):
        raise ValueError(f"moe_type must be a string such as 'ffn-14:28', got {moe_type!r}")
    if ":" in moe_type:
        kind, sep, layers = moe_type.partition("-")
        bounds = layers.split(":")
        if not sep or "-" in layers or len(bounds) != 2 or not all(b.isdigit() for b in bounds):
            raise ValueError(f"moe_type {moe_type!r} is not TYPE-START:END with non-negative integers START <= END")
        start, end = int(bounds[0]), int(bounds[1])
        if start > end:
            raise ValueError(f"moe_type {moe_type!r}: range start {start} is after end {end}")
    else:
        kind, start, end = moe_type, 0, math.inf
    if kind not in MOE_TYPES:
        raise ValueError(f"moe_type {moe_type!r}: type {kind!r} is not one of {', '.join(MOE_TYPES)}")
    return kind, start, end


def moe_enable(moe_type: str, layer_type: str, layer_idx: int) -> bool:
    """Does `moe_type` give layer `layer_idx` a gen expert of `layer_type` ("ffn" / "attention")?"""
    kind, start, end = moe_layer_range(moe_type)
    return layer_type in kind and start <= layer_idx < end


SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def bad_value(name: str, value: Any) -> str | None:
    """What no engine can run for config key `name`: a zero or negative size, a zero, negative or
    non-finite eps or theta, a gen start that is not an int (None where nothing is wrong)."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if name in (*SIZE_KEYS, "gen_vocab_size"):
        return None if is_int and value > 0 else "expected a positive int"
    if name in ("rms_norm_eps", "rope_theta"):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if number and math.isfinite(value) and value > 0 else "expected a positive, finite float"
    if name == "gen_vocab_start_index":
        return None if value is None or is_int else "expected an int or null"
    return None


def check_values(data: Mapping[str, Any], source: str, prefix: str = "") -> None:
    """Types (`check_field_types`) and values (`bad_value`) of the keys of `data`, one line naming the key."""
    check_field_types(MammothModa2ARConfig, data, source, prefix)
    for name, value in data.items():
        problem = bad_value(name, value)
        if problem:
            raise ValueError(f"{source}: key '{prefix}{name}': {problem}, found {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class MammothModa2ARConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float = 1_000_000.0  # defaults: upstream's Qwen2.5 text config
    rms_norm_eps: float = 1e-5
    extra_gen_vocab: bool = True
    gen_vocab_size: int = 32800
    gen_vocab_start_index: int | None = None  # None: vocab_size
    moe_type: str = "ffn"
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    model_type: str = QWEN2_MODEL_TYPE

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if bad_value(name, value):
                raise ValueError(f"{name}: {bad_value(name, value)}, found {type(value).__name__} {value!r}")
        if self.gen_vocab_start_index is None:
            start = self.vocab_size if self.extra_gen_vocab else self.vocab_size - self.gen_vocab_size
            object.__setattr__(self, "gen_vocab_start_index", start)
        moe_layer_range(self.moe_type)
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"heads do not divide: hidden_size {self.hidden_size}, num_attention_heads "
                f"{self.num_attention_heads}, num_key_value_heads {self.num_key_value_heads}"
            )
        if self.gen_vocab_start_index < 0:  # Dev: the gen start (152064) is past its 151936-row text table
            raise ValueError(f"gen_vocab_start_index {self.gen_vocab_start_index} must be non-negative")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (SwiGLU experts need 'silu')")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings must be false (lm_head and gen_head are untied)")
        if self.model_type not in (QWEN2_MODEL_TYPE, QWEN3_MODEL_TYPE):
            raise ValueError(f"model_type {self.model_type!r} is not one of {QWEN2_MODEL_TYPE}, {QWEN3_MODEL_TYPE}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def base_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def logits_width(self) -> int:
        return self.vocab_size + (self.gen_vocab_size if self.extra_gen_vocab else 0)

    def token_of_column(self, column: Any) -> Any:
        """Logits column -> token id: gen column `vocab_size + j` is token `gen_vocab_start_index + j`."""
        if not self.extra_gen_vocab or self.gen_vocab_start_index == self.vocab_size:
            return column
        return column + (column >= self.vocab_size) * (self.gen_vocab_start_index - self.vocab_size)

    def to_dict(self) -> dict[str, Any]:
        return {"architectures": ["MammothModa2ARForCausalLM"], **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> MammothModa2ARConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields - HF_METADATA_KEYS)
        if unknown:
            raise ValueError(f"{source}: unknown AR config keys {unknown}")
        check_values({k: v for k, v in data.items() if k in fields}, source)
        try:
            return cls(**{k: v for k, v in data.items() if k in fields})
        except TypeError as exc:  # a required key absent
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def from_any(cls, config: Any) -> MammothModa2ARConfig:
        """Accept this class, a mapping, or any object carrying the upstream field names."""
        if isinstance(config, cls):
            return config
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        fields = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(config, name) for name in fields if hasattr(config, name)})

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> MammothModa2ARConfig:
        """Our flat config.json, or a release's nested one (`from_release`)."""
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: no config.json")
        data = read_json_object(path)
        if "llm_config" in data:
            return cls.from_release(data, source=str(path))
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_release(cls, data: Mapping[str, Any], *, source: str = "config") -> MammothModa2ARConfig:
        """The text settings of a release `Mammothmoda2Config`: `llm_config.text_config`, with
        `llm_config`'s own gen keys where the text config lacks them and upstream's defaults for
        the rest; keys the model does not read are ignored, what it cannot run is refused."""
        llm = data["llm_config"]
        if not isinstance(llm, Mapping) or not isinstance(llm.get("text_config", {}), Mapping):
            raise ValueError(f"{source}: key 'llm_config' and its 'text_config': expected JSON objects")
        model_type = llm.get("model_type", QWEN2_MODEL_TYPE)
        text = {**{k: v for k, v in llm.items() if k in RELEASE_LLM_KEYS}, **llm.get("text_config", {})}
        defaults = RELEASE_DEFAULTS.get(model_type)
        if defaults is None:
            raise ValueError(f"{source}: llm_config.model_type {model_type!r} is not {QWEN2_MODEL_TYPE} or {QWEN3_MODEL_TYPE}")
        rope = text.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
            raise ValueError(f"{source}: rope_scaling {rope!r}: only default / mrope RoPE is implemented")
        if text.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window is true: sliding-window attention is not implemented")
        fields = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in text.items() if k in fields and k != "model_type"}
        check_values({k: v for k, v in llm.items() if k in RELEASE_LLM_KEYS}, source, prefix="llm_config.")
        check_values(
            {k: v for k, v in llm.get("text_config", {}).items() if k in given}, source, prefix="llm_config.text_config."
        )
        values = {**defaults, **given, "model_type": model_type}
        return cls(**values)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

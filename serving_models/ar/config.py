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


@dataclass(frozen=True)
class MammothModa2ARConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    extra_gen_vocab: bool = True
    gen_vocab_size: int = 32800
    gen_vocab_start_index: int = 152064
    moe_type: str = "ffn-14:28"
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    model_type: str = QWEN2_MODEL_TYPE

    def __post_init__(self) -> None:
        moe_layer_range(self.moe_type)
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"heads do not divide: hidden_size {self.hidden_size}, num_attention_heads "
                f"{self.num_attention_heads}, num_key_value_heads {self.num_key_value_heads}"
            )
        if self.extra_gen_vocab and self.vocab_size != self.gen_vocab_start_index:
            raise ValueError(f"vocab_size {self.vocab_size} must equal gen_vocab_start_index {self.gen_vocab_start_index}")
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

    def to_dict(self) -> dict[str, Any]:
        return {"architectures": ["MammothModa2ARForCausalLM"], **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> MammothModa2ARConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields - HF_METADATA_KEYS)
        if unknown:
            raise ValueError(f"{source}: unknown AR config keys {unknown}")
        check_field_types(cls, data, source)
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
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: no config.json")
        return cls.from_dict(read_json_object(path), source=str(path))

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

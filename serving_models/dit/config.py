"""The serving port's reading of a DiT checkpoint's `config.json`.

A serving engine parses the checkpoint's configuration itself, so this is independent of the
reference package; it accepts the same JSON fields (upstream diffusers names plus `vae_decoder`).
`DiTConfig.coerce` also takes any object with `to_json_dict()` (e.g. the reference's config), so
a suite can build both implementations from one configuration.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving_models.common.safetensors_io import check_field_types, read_json_object

CLASS_NAME = "Transformer2DModel"


@dataclass(frozen=True)
class DecoderConfig:
    latent_channels: int = 16
    block_out_channels: tuple[int, ...] = (32, 16, 8, 8)
    scaling_factor: float = 0.3611
    shift_factor: float = 0.1159


@dataclass(frozen=True)
class DiTConfig:
    patch_size: int = 2
    in_channels: int = 16
    out_channels: int = 16
    hidden_size: int = 96
    num_layers: int = 2
    num_refiner_layers: int = 1
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    multiple_of: int = 16
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    axes_dim_rope: tuple[int, int, int] = (12, 6, 6)
    axes_lens: tuple[int, int, int] = (128, 128, 128)
    text_feat_dim: int = 64
    timestep_scale: float = 1.0
    rope_theta: float = 10000.0
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    name: str = "custom"

    def __post_init__(self) -> None:
        for name in (
            "patch_size",
            "in_channels",
            "out_channels",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_kv_heads",
            "multiple_of",
            "text_feat_dim",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DiT config {self.name!r}: {name} {value!r}: expected an int >= 1")
        for name in ("norm_eps", "timestep_scale", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"DiT config {self.name!r}: {name} {value!r}: expected a positive, finite float")
        if not 0 < self.decoder.scaling_factor < math.inf or not math.isfinite(self.decoder.shift_factor):
            raise ValueError(
                f"DiT config {self.name!r}: vae_decoder scaling_factor {self.decoder.scaling_factor!r} / shift_factor "
                f"{self.decoder.shift_factor!r}: expected a positive, finite scale and a finite shift"
            )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"DiT config {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.head_dim != sum(self.axes_dim_rope):
            raise ValueError(
                f"DiT config {self.name!r}: hidden_size / num_attention_heads = {self.head_dim} "
                f"must equal sum(axes_dim_rope) = sum({tuple(self.axes_dim_rope)}) = "
                f"{sum(self.axes_dim_rope)} (the RoPE axes are concatenated along head_dim)"
            )
        if any(d % 2 for d in self.axes_dim_rope) or len(self.axes_dim_rope) != 3:
            raise ValueError(f"DiT config {self.name!r}: axes_dim_rope must be 3 even sizes, got {self.axes_dim_rope}")
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"DiT config {self.name!r}: num_attention_heads {self.num_attention_heads} is not a "
                f"multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def temb_dim(self) -> int:
        return min(self.hidden_size, 1024)

    @property
    def ffn_inner_dim(self) -> int:
        inner = 4 * self.hidden_size
        if self.ffn_dim_multiplier is not None:
            inner = int(self.ffn_dim_multiplier * inner)
        return self.multiple_of * ((inner + self.multiple_of - 1) // self.multiple_of)

    @classmethod
    def from_json_dict(cls, data: dict[str, Any], source: str = "<dict>") -> DiTConfig:
        data = dict(data)
        if data.pop("_class_name", CLASS_NAME) != CLASS_NAME:
            raise ValueError(f"{source}: _class_name is not {CLASS_NAME!r}")
        name = data.pop("_parity_config_name", "custom")
        decoder = data.pop("vae_decoder", None)
        if decoder is None:
            raise ValueError(f"{source}: missing key 'vae_decoder'")
        known = {f.name for f in dataclasses.fields(cls)} - {"decoder", "name"}
        problems = []
        if set(data) - known:
            problems.append(f"unknown keys {sorted(set(data) - known)}")
        if known - set(data):
            problems.append(f"missing keys {sorted(known - set(data))}")
        dec_known = {f.name for f in dataclasses.fields(DecoderConfig)}
        if set(decoder) ^ dec_known:
            problems.append(f"vae_decoder keys {sorted(decoder)} != {sorted(dec_known)}")
        if problems:
            raise ValueError(f"{source}: " + "; ".join(problems))
        check_field_types(cls, data, source)
        check_field_types(DecoderConfig, decoder, source, prefix="vae_decoder.")
        for key in ("axes_dim_rope", "axes_lens"):
            data[key] = tuple(data[key])
        decoder = dict(decoder, block_out_channels=tuple(decoder["block_out_channels"]))
        try:
            return cls(**data, decoder=DecoderConfig(**decoder), name=name)
        except ValueError as exc:  # a value no model can run (a zero size, a negative eps): say which file
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> DiTConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"DiT checkpoint config not found: {path}")
        return cls.from_json_dict(read_json_object(path), source=str(path))

    @classmethod
    def coerce(cls, config: Any) -> DiTConfig:
        """This class from itself, a config.json dict, or an object with `to_json_dict()`."""
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            return cls.from_json_dict(config)
        if hasattr(config, "to_json_dict"):
            return cls.from_json_dict(config.to_json_dict(), source=type(config).__qualname__)
        raise TypeError(f"cannot read a DiT config from {type(config).__qualname__}")

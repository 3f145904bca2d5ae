"""Configuration of the MammothModa2 DiT stage (docs/model.md §6, §9): the transformer and its decoder.

One dataclass pair describes both configurations the harness runs: `tiny` (CPU lane, the shape of
vllm-omni's `test_dit_compile_parity.py`) and `full` (MammothModa2-Preview shapes). The JSON form
is the `config.json` of an HF-style checkpoint directory, with the upstream diffusers field names
(`hidden_size`, `num_refiner_layers`, `axes_dim_rope`, ...) plus a `vae_decoder` table.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference_models.common.hf_checkpoint import check_field_types, read_json_object

CLASS_NAME = "Transformer2DModel"


@dataclass(frozen=True)
class DecoderConfig:
    """The small deterministic latent decoder that stands in for `AutoencoderKL.decode`.

    The 16-channel VAE's type and factors are unconfirmed (docs/model.md §1); the factors default to the
    16-channel FLUX VAE's (OmniGen2, the DiT's ancestor, decodes with it). Each entry of
    `block_out_channels` after the first is one nearest ×2 upsampling stage, so three stages give
    the VAE's 8× spatial factor.
    """

    latent_channels: int = 16
    block_out_channels: tuple[int, ...] = (32, 16, 8, 8)
    scaling_factor: float = 0.3611  # unconfirmed (FLUX VAE value)
    shift_factor: float = 0.1159  # unconfirmed (FLUX VAE value)

    @property
    def upsample_factor(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)


@dataclass(frozen=True)
class DiTConfig:
    """`Transformer2DModel` hyper-parameters under their upstream names (docs/model.md §6, §9)."""

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
        self.validate()

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def temb_dim(self) -> int:
        """Width of the timestep embedding and of every adaLN input: min(hidden, 1024)."""
        return min(self.hidden_size, 1024)

    @property
    def ffn_inner_dim(self) -> int:
        """`round_up(4·dim·(ffn_dim_multiplier or 1), multiple_of)` as LuminaFeedForward computes it."""
        inner = 4 * self.hidden_size
        if self.ffn_dim_multiplier is not None:
            inner = int(self.ffn_dim_multiplier * inner)
        return self.multiple_of * ((inner + self.multiple_of - 1) // self.multiple_of)

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.in_channels

    # -- checks --------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the field when the shapes cannot form a DiT."""
        problem = self.value_problem()
        if problem:
            raise ValueError(f"DiT config {self.name!r}: {problem}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"DiT config {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.head_dim != sum(self.axes_dim_rope):
            raise ValueError(
                f"DiT config {self.name!r}: hidden_size / num_attention_heads = "
                f"{self.hidden_size} / {self.num_attention_heads} = {self.head_dim} must equal "
                f"sum(axes_dim_rope) = sum({tuple(self.axes_dim_rope)}) = {sum(self.axes_dim_rope)} "
                "(the three RoPE axes are concatenated along head_dim)"
            )
        if any(d % 2 for d in self.axes_dim_rope):
            raise ValueError(
                f"DiT config {self.name!r}: every axes_dim_rope entry must be even (RoPE rotates "
                f"pairs), got {tuple(self.axes_dim_rope)}"
            )
        if len(self.axes_dim_rope) != 3 or len(self.axes_lens) != 3:
            raise ValueError(
                f"DiT config {self.name!r}: axes_dim_rope and axes_lens need 3 entries (t, h, w), "
                f"got {tuple(self.axes_dim_rope)} and {tuple(self.axes_lens)}"
            )
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"DiT config {self.name!r}: num_attention_heads {self.num_attention_heads} is not "
                f"a multiple of num_kv_heads {self.num_kv_heads} (grouped-query attention)"
            )
        if self.decoder.latent_channels != self.out_channels:
            raise ValueError(
                f"DiT config {self.name!r}: vae_decoder.latent_channels "
                f"{self.decoder.latent_channels} != out_channels {self.out_channels}"
            )

    # Lower bounds of the integer fields: a zero size or head count cannot form a DiT (and would
    # divide by zero below); refiners may be absent.
    INT_MINIMUM = {
        "patch_size": 1,
        "in_channels": 1,
        "out_channels": 1,
        "hidden_size": 1,
        "num_layers": 1,
        "num_refiner_layers": 0,
        "num_attention_heads": 1,
        "num_kv_heads": 1,
        "multiple_of": 1,
        "text_feat_dim": 1,
    }

    def value_problem(self) -> str | None:
        """A value no DiT can run (a zero size, a non-positive or non-finite eps, scale or factor,
        a non-integer axis), in the release's config as in parity's; None when there is none."""

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def positive(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0

        for name, low in self.INT_MINIMUM.items():
            value = getattr(self, name)
            if not is_int(value) or value < low:
                return f"{name} {value!r}: expected an int >= {low}"
        for name in ("norm_eps", "timestep_scale", "rope_theta"):
            if not positive(getattr(self, name)):
                return f"{name} {getattr(self, name)!r}: expected a positive, finite float"
        if self.ffn_dim_multiplier is not None and not positive(self.ffn_dim_multiplier):
            return f"ffn_dim_multiplier {self.ffn_dim_multiplier!r}: expected null or a positive, finite float"
        if not all(is_int(d) and d >= 0 for d in self.axes_dim_rope) or not all(is_int(n) and n >= 1 for n in self.axes_lens):
            return f"axes_dim_rope {list(self.axes_dim_rope)} / axes_lens {list(self.axes_lens)}: expected ints (lengths >= 1)"
        decoder = self.decoder
        if not is_int(decoder.latent_channels) or decoder.latent_channels < 1:
            return f"latent_channels {decoder.latent_channels!r}: expected an int >= 1"
        if not decoder.block_out_channels or not all(is_int(c) and c >= 1 for c in decoder.block_out_channels):
            return f"block_out_channels {list(decoder.block_out_channels)}: expected one or more ints >= 1"
        if not positive(decoder.scaling_factor):
            return f"scaling_factor {decoder.scaling_factor!r}: expected a positive, finite float (latents are divided by it)"
        shift = decoder.shift_factor
        if not (isinstance(shift, (int, float)) and not isinstance(shift, bool) and math.isfinite(shift)):
            return f"shift_factor {decoder.shift_factor!r}: expected a finite float"
        return None

    # -- JSON ------------------------------------------------------------------------------------
    def to_json_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        decoder = data.pop("decoder")
        name = data.pop("name")
        out: dict[str, Any] = {"_class_name": CLASS_NAME, "_parity_config_name": name}
        out.update({k: list(v) if isinstance(v, tuple) else v for k, v in data.items()})
        out["vae_decoder"] = {k: list(v) if isinstance(v, tuple) else v for k, v in decoder.items()}
        return out

    @classmethod
    def from_json_dict(cls, data: dict[str, Any], source: str = "<dict>") -> DiTConfig:
        """Parse a `config.json` dict; unknown or missing fields raise naming `source` and the key."""
        data = dict(data)
        class_name = data.pop("_class_name", CLASS_NAME)
        if class_name != CLASS_NAME:
            raise ValueError(f"{source}: _class_name is {class_name!r}, expected {CLASS_NAME!r}")
        name = data.pop("_parity_config_name", "custom")
        decoder_data = data.pop("vae_decoder", None)
        if decoder_data is None:
            raise ValueError(f"{source}: missing key 'vae_decoder'")
        fields = {f.name for f in dataclasses.fields(cls)} - {"decoder", "name"}
        unknown = sorted(set(data) - fields)
        missing = sorted(fields - set(data))
        dec_fields = {f.name for f in dataclasses.fields(DecoderConfig)}
        dec_unknown = sorted(set(decoder_data) - dec_fields)
        dec_missing = sorted(dec_fields - set(decoder_data))
        problems = []
        if unknown:
            problems.append(f"unknown keys {unknown}")
        if missing:
            problems.append(f"missing keys {missing}")
        if dec_unknown:
            problems.append(f"unknown keys in vae_decoder {dec_unknown}")
        if dec_missing:
            problems.append(f"missing keys in vae_decoder {dec_missing}")
        if problems:
            raise ValueError(f"{source}: " + "; ".join(problems))
        check_field_types(cls, data, source)
        check_field_types(DecoderConfig, decoder_data, source, prefix="vae_decoder.")
        tuples = {"axes_dim_rope", "axes_lens"}
        kwargs = {k: tuple(v) if k in tuples else v for k, v in data.items()}
        decoder = DecoderConfig(**{k: tuple(v) if k == "block_out_channels" else v for k, v in decoder_data.items()})
        return cls(**kwargs, decoder=decoder, name=name)

    @classmethod
    def from_file(cls, path: str | Path) -> DiTConfig:
        path = Path(path)
        try:
            data = read_json_object(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"DiT checkpoint config not found: {path}") from None
        return cls.from_json_dict(data, source=str(path))

    def num_parameters(self) -> int:
        """Parameter count of the transformer (not the decoder), for the docs and reports."""
        d, hd, t = self.hidden_size, self.head_dim, self.temb_dim
        attn = d * d + 2 * d * self.num_kv_heads * hd + d * d + 2 * hd
        ffn = 3 * d * self.ffn_inner_dim
        norms = 4 * d
        plain_block = attn + ffn + norms
        modulated_block = plain_block - d + t * 4 * d + 4 * d + d
        embed = self.patch_dim * d + d + 256 * t + t + t * t + t
        embed += self.text_feat_dim + self.text_feat_dim * d + d
        head = t * d + d + d * self.patch_size**2 * self.out_channels + self.patch_size**2 * self.out_channels
        return embed + self.num_refiner_layers * (plain_block + modulated_block) + self.num_layers * modulated_block + head


def tiny_config() -> DiTConfig:
    """CPU-lane DiT (docs/model.md §9): hidden 96, heads 4/2 (hd 24), axes (12,6,6), FFN 384, text dim 64."""
    return DiTConfig(name="tiny")


def full_config() -> DiTConfig:
    """MammothModa2-Preview DiT shapes (docs/model.md §9).

    Confirmed (labelled Preview shapes in vllm-omni's `test_dit_attention_cuda.py`): hidden 2520,
    heads 21 / KV 7 (hd 120), axes (40,40,40). Derived: FFN 10240 (multiple_of 256), temb 1024.
    LLM width 3584 is Qwen2.5-VL-7B's hidden size (Preview backbone). RoPE θ 10000 is hard-coded
    upstream. The rest is unconfirmed and marked where it is set.
    """
    config = DiTConfig(
        patch_size=2,
        in_channels=16,
        out_channels=16,
        hidden_size=2520,
        # UNCONFIRMED: no upstream source states the layer count. 20 gives ~2.5e9 transformer
        # parameters with the refiners (see num_parameters()); the README's "2B" suggests 16-20.
        num_layers=20,
        # UNCONFIRMED: the upstream class default and OmniGen2 use 2 (each of context/noise refiner).
        num_refiner_layers=2,
        num_attention_heads=21,
        num_kv_heads=7,
        multiple_of=256,
        ffn_dim_multiplier=None,
        norm_eps=1e-5,
        axes_dim_rope=(40, 40, 40),
        # UNCONFIRMED: the top-level MammothModa2 default is 10000 per axis (vllm-omni comments
        # ask for >= 1024); the tables are indexed by position, so only the bound matters.
        axes_lens=(10000, 10000, 10000),
        text_feat_dim=3584,
        # UNCONFIRMED: OmniGen2 (same DiT family, t in [0, 1]) uses 1000.
        timestep_scale=1000.0,
        rope_theta=10000.0,
        decoder=DecoderConfig(block_out_channels=(128, 64, 32, 32)),
        name="full",
    )
    return config


CONFIGS = {"tiny": tiny_config, "full": full_config}


def config_for_size(size: str) -> DiTConfig:
    try:
        return CONFIGS[size]()
    except KeyError:
        raise ValueError(f"unknown DiT size {size!r}; expected one of {sorted(CONFIGS)}") from None

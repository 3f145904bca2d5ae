"""The DiT side of the release checkpoint layout (docs/model.md §10): config and tensor names.

The released MammothModa2 directory holds one composite model. Its `config.json` is the
top-level `Mammothmoda2Config`: the DiT's diffusers config under `gen_dit_config` (its
`axes_dim_rope` / `axes_lens` size the RoPE tables on the text-to-image path), the VAE's under
`gen_vae_config`, the composite's own `gen_axes_dim_rope` / `gen_axes_lens`, the LLM's config under `llm_config` (whose text width re-creates the DiT's caption embedder).
Its state dict puts the transformer under `gen_transformer.`, the VAE under `gen_vae.` and the
LLM under `llm_model.`. This module maps that layout onto the reference's `DiTConfig` and tensor
names and says, for every release tensor this pipeline does not read, why; it is the DiT family's
hook for a release-layout reader (`read_checkpoint` calls it when `config.json` is a release
config) and for `make_dit_checkpoint(..., layout="release")`. `LAYOUT` (at the end) is the family's
`ReleaseLayout` (config keys, `parse_dit`, tensor rules), registered under "dit" in
`reference_models/families.py`.

The decoder: a released directory decodes with its VAE (`gen_vae.*`, diffusers' `AutoencoderKL`
built from `gen_vae_config`: `vae.py`); a parity-written release directory carries parity's seeded
stand-in decoder instead, under `vae_decoder.` with its shape under the config key
`parity_stand_in_decoder`, and the stand-in decodes wherever it is present. A directory with
neither cannot decode. Tensors under a prefix no family claims are listed and never read
(docs/checkpoints.md §2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from reference_models.common.hf_checkpoint import check_field_types
from reference_models.common.release_layout import CONFIG_FILE, ParsedConfig, ReleaseLayout, TensorRule

from .config import DecoderConfig, DiTConfig

TRANSFORMER_PREFIX = "gen_transformer."
DECODER_PREFIX = "vae_decoder."
VAE_PREFIX = "gen_vae."
VAE_BESIDE_STAND_IN = (
    "the release's VAE (AutoencoderKL): parity's stand-in decoder (vae_decoder.*) is present and decodes instead"
)
UNCLAIMED = "no model family claims this prefix: never read (docs/checkpoints.md §2)"
STAND_IN_DECODER_KEY = "parity_stand_in_decoder"

# Upstream `Transformer2DModel.__init__` defaults, for keys a `gen_dit_config` leaves out.
DIT_DEFAULTS: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": None,
    "hidden_size": 2304,
    "num_layers": 26,
    "num_refiner_layers": 2,
    "num_attention_heads": 24,
    "num_kv_heads": 8,
    "multiple_of": 256,
    "ffn_dim_multiplier": None,
    "norm_eps": 1e-5,
    "axes_dim_rope": (32, 32, 32),
    "axes_lens": (300, 512, 512),
    "text_feat_dim": 1024,
    "timestep_scale": 1.0,
}
# `Mammothmoda2Config` defaults for the sampler's RoPE tables.
RELEASE_AXES_DIM = (40, 40, 40)
RELEASE_AXES_LENS = (10000, 10000, 10000)
# The release re-creates the caption embedder with this RMSNorm eps, whatever `norm_eps` says.
CAPTION_NORM_EPS = 1e-5

IGNORED_DIT_KEYS = {
    "_class_name": "diffusers bookkeeping",
    "_diffusers_version": "diffusers bookkeeping",
    "is_image_embedder": "the release re-creates the image embedder regardless (its tensors are listed as unused)",
}

# Release tensors this pipeline does not read: (name prefix, reason). Checked in order.
UNUSED_TENSORS: tuple[tuple[str, str], ...] = (
    (
        TRANSFORMER_PREFIX + "time_caption_embed.image_embedder.",
        "the Q-Former over the AR's generated image tokens (gen_condition_mode with 'image'): this "
        "pipeline conditions the DiT on text states only, the conditioning stage is out of scope",
    ),
    (
        TRANSFORMER_PREFIX + "ref_image_patch_embedder.",
        "reference-image (editing) input: text-to-image passes no reference images",
    ),
    (
        TRANSFORMER_PREFIX + "ref_image_refiner.",
        "reference-image (editing) refiner: text-to-image passes no reference images",
    ),
    (
        TRANSFORMER_PREFIX + "image_index_embedding",
        "per-reference-image index embedding: text-to-image passes no reference images",
    ),
    ("llm_model.", "the AR backbone's tensors: read by the AR family's loader"),
)


def is_release_config(data: Mapping[str, Any]) -> bool:
    """A top-level MammothModa2 config (it has a `gen_dit_config`), not a parity DiT config."""
    return "gen_dit_config" in data


def _llm_width(data: Mapping[str, Any]) -> int | None:
    llm = data.get("llm_config") or {}
    text = llm.get("text_config") or {}
    return text.get("hidden_size", llm.get("hidden_size"))


def config_from_release(data: Mapping[str, Any], source: str) -> tuple[DiTConfig, dict[str, str]]:
    """The reference `DiTConfig` of a release config, and the keys it did not use with why.

    Absent `gen_dit_config` keys take upstream's defaults; the RoPE tables are
    `gen_dit_config`'s (`axes_dim_rope`, `axes_lens`: what the text-to-image path builds them
    from); the caption embedder's input width is the LLM's (the release re-creates it so). Wrong
    types and contradictions raise naming `source` and the keys."""
    dit = dict(DIT_DEFAULTS)
    if not isinstance(data["gen_dit_config"], Mapping):
        raise ValueError(f"{source}: key 'gen_dit_config': expected a JSON object, found {type(data['gen_dit_config']).__name__}")
    given = dict(data["gen_dit_config"])
    notes = {key: reason for key, reason in IGNORED_DIT_KEYS.items() if key in given}
    unknown = sorted(set(given) - set(DIT_DEFAULTS) - set(IGNORED_DIT_KEYS))
    if unknown:
        raise ValueError(f"{source}: gen_dit_config has keys this DiT does not know: {unknown}")
    _check_types(given, data, source)
    dit.update({k: v for k, v in given.items() if k in DIT_DEFAULTS})
    if dit["out_channels"] is None:
        dit["out_channels"] = dit["in_channels"]
    axes_dim = tuple(data.get("gen_axes_dim_rope") or RELEASE_AXES_DIM)
    if axes_dim != tuple(dit["axes_dim_rope"]):
        raise ValueError(
            f"{source}: gen_axes_dim_rope {list(axes_dim)} contradicts gen_dit_config.axes_dim_rope "
            f"{list(dit['axes_dim_rope'])} (the tables are split by the transformer's axes)"
        )
    # The text-to-image path builds the transformer's RoPE tables from gen_dit_config.axes_lens
    # (diffusers' default (300, 512, 512) when absent); the composite config's gen_axes_lens are not
    # read there (docs/model.md §10).
    axes_lens = tuple(dit["axes_lens"])
    if "gen_axes_lens" in data:
        notes["gen_axes_lens"] = (
            f"the composite config's RoPE lengths: the text-to-image path builds its tables from "
            f"gen_dit_config.axes_lens {list(axes_lens)}"
        )
    width = _llm_width(data)
    if width is not None and width != dit["text_feat_dim"]:
        notes["gen_dit_config.text_feat_dim"] = f"the caption embedder is re-created for the LLM width {width}"
    if float(dit["norm_eps"]) != CAPTION_NORM_EPS:
        raise ValueError(
            f"{source}: gen_dit_config.norm_eps {dit['norm_eps']} differs from the caption embedder's "
            f"{CAPTION_NORM_EPS} (the release re-creates it with that eps); this DiT ties the two"
        )
    vae = dict(data.get("gen_vae_config") or {})
    stand_in = dict(data.get(STAND_IN_DECODER_KEY) or {})
    decoder = DecoderConfig(
        latent_channels=vae.get("latent_channels", dit["out_channels"]),
        block_out_channels=tuple(stand_in.get("block_out_channels", DecoderConfig.block_out_channels)),
        scaling_factor=vae.get("scaling_factor", DecoderConfig.scaling_factor),
        shift_factor=0.0
        if "shift_factor" in vae and vae["shift_factor"] is None
        else vae.get("shift_factor", DecoderConfig.shift_factor),
    )
    for key in ("gen_condition_mode", "gen_condition_layers", "gen_transport_config", "gen_image_condition_refiner_config"):
        if key in data:
            notes[key] = "conditioning and training settings outside the DiT stage parity runs"
    config = DiTConfig(
        **{k: tuple(v) if k == "axes_dim_rope" else v for k, v in dit.items() if k not in ("axes_lens", "text_feat_dim")},
        axes_lens=axes_lens,
        text_feat_dim=width if width is not None else dit["text_feat_dim"],
        rope_theta=10000.0,  # hard-coded upstream
        decoder=decoder,
        name=f"release:{source}",
    )
    return config, notes


def _check_types(given: Mapping[str, Any], data: Mapping[str, Any], source: str) -> None:
    """The release's DiT and VAE settings hold the types the flat layout checks (one line naming
    the key path): scalars by `check_field_types`, the axes as three ints, the sections as objects."""
    check_field_types(
        DiTConfig, {k: v for k, v in given.items() if k in DIT_DEFAULTS and v is not None}, source, prefix="gen_dit_config."
    )
    for key in ("axes_dim_rope", "axes_lens"):
        value = given.get(key)
        if value is not None and not (isinstance(value, list) and len(value) == 3 and all(type(v) is int for v in value)):
            raise ValueError(f"{source}: key 'gen_dit_config.{key}': expected a list of 3 ints, found {value!r}")
    for key in ("gen_axes_dim_rope", "gen_axes_lens"):
        value = data.get(key)
        if value is not None and not (isinstance(value, list) and all(type(v) is int for v in value)):
            raise ValueError(f"{source}: key '{key}': expected a list of ints, found {value!r}")
    for key in ("gen_vae_config", STAND_IN_DECODER_KEY):
        if data.get(key) is not None and not isinstance(data[key], Mapping):
            raise ValueError(f"{source}: key '{key}': expected a JSON object, found {type(data[key]).__name__}")
    vae = data.get("gen_vae_config") or {}
    factors = {k: vae[k] for k in ("latent_channels", "scaling_factor", "shift_factor") if vae.get(k) is not None}
    check_field_types(DecoderConfig, factors, source, prefix="gen_vae_config.")


def unused_reason(name: str) -> str | None:
    """Why this pipeline does not read release tensor `name`, or None if it is not a known unused one."""
    for prefix, reason in UNUSED_TENSORS:
        if name.startswith(prefix):
            return reason
    return None


def split_release_tensors(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, torch.Tensor]]:
    """(the tensors under the reference's names, {unused release name: reason}, the VAE's tensors).

    `gen_transformer.X` becomes `X`, `vae_decoder.*` (parity's stand-in) is kept as is; `gen_vae.*`
    decodes unless the stand-in is present (then it is listed unused); a tensor under a prefix no
    family claims is listed with `UNCLAIMED` and never read."""
    used: dict[str, torch.Tensor] = {}
    unused: dict[str, str] = {}
    vae: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        reason = unused_reason(name)
        if reason is not None:
            unused[name] = reason
        elif name.startswith(TRANSFORMER_PREFIX):
            used[name[len(TRANSFORMER_PREFIX) :]] = tensor
        elif name.startswith(DECODER_PREFIX):
            used[name] = tensor
        elif name.startswith(VAE_PREFIX):
            vae[name] = tensor
        else:
            unused[name] = UNCLAIMED
    if vae and any(name.startswith(DECODER_PREFIX) for name in used):
        unused.update(dict.fromkeys(vae, VAE_BESIDE_STAND_IN))
        vae = {}
    return used, unused, vae


def release_config_dict(config: DiTConfig, llm_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A top-level release `config.json` for `config` (the DiT side; `llm_config` as given, or the
    minimum that states the LLM width)."""
    dit = {
        "_class_name": "Transformer2DModel",
        "patch_size": config.patch_size,
        "in_channels": config.in_channels,
        "out_channels": config.out_channels,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "num_refiner_layers": config.num_refiner_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_kv_heads": config.num_kv_heads,
        "multiple_of": config.multiple_of,
        "ffn_dim_multiplier": config.ffn_dim_multiplier,
        "norm_eps": config.norm_eps,
        "axes_dim_rope": list(config.axes_dim_rope),
        "axes_lens": list(config.axes_lens),
        "text_feat_dim": config.text_feat_dim,
        "timestep_scale": config.timestep_scale,
    }
    decoder = config.decoder
    return {
        "model_type": "mammothmoda2",
        "architectures": ["Mammothmoda2Model"],
        "llm_config": dict(llm_config) if llm_config is not None else {"text_config": {"hidden_size": config.text_feat_dim}},
        "gen_dit_config": dit,
        "gen_vae_config": {
            "_class_name": "AutoencoderKL",
            "latent_channels": decoder.latent_channels,
            "scaling_factor": decoder.scaling_factor,
            "shift_factor": decoder.shift_factor,
        },
        "gen_axes_dim_rope": list(config.axes_dim_rope),
        "gen_axes_lens": list(config.axes_lens),
        STAND_IN_DECODER_KEY: {"block_out_channels": list(decoder.block_out_channels)},
    }


def unused_release_shapes(config: DiTConfig, num_queries: int = 8, embedder_layers: int = 1) -> dict[str, tuple[int, ...]]:
    """Shapes of the release's DiT tensors this pipeline leaves unread, as its modules declare them
    (the image embedder with `num_queries` queries and `embedder_layers` layers, the release's
    `gen_image_condition_refiner_config`), so a parity-written release directory carries them."""
    h, d, p2c = config.hidden_size, config.text_feat_dim, config.patch_size**2 * config.in_channels
    shapes: dict[str, tuple[int, ...]] = {}
    embedder = TRANSFORMER_PREFIX + "time_caption_embed.image_embedder."
    shapes[embedder + "input_proj.0.weight"] = (d,)
    shapes[embedder + "input_proj.1.weight"] = (h, d)
    shapes[embedder + "input_proj.1.bias"] = (h,)
    shapes[embedder + "query"] = (1, num_queries, h)
    for i in range(embedder_layers):
        layer = f"{embedder}layers.{i}."
        for norm in ("ln_q1", "ln_q2", "ln_ffn"):
            shapes[f"{layer}{norm}.weight"] = (h,)
        for attn in ("self_attn", "cross_attn"):
            shapes[f"{layer}{attn}.in_proj_weight"] = (3 * h, h)
            shapes[f"{layer}{attn}.in_proj_bias"] = (3 * h,)
            shapes[f"{layer}{attn}.out_proj.weight"] = (h, h)
            shapes[f"{layer}{attn}.out_proj.bias"] = (h,)
        inner = 256 * ((4 * h + 255) // 256)
        shapes[f"{layer}ffn.linear_1.weight"] = (inner, h)
        shapes[f"{layer}ffn.linear_2.weight"] = (h, inner)
        shapes[f"{layer}ffn.linear_3.weight"] = (inner, h)
    shapes[TRANSFORMER_PREFIX + "ref_image_patch_embedder.weight"] = (h, p2c)
    shapes[TRANSFORMER_PREFIX + "ref_image_patch_embedder.bias"] = (h,)
    shapes[TRANSFORMER_PREFIX + "image_index_embedding"] = (5, h)
    return shapes


def release_state_dict(config: DiTConfig, state: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """`state` (reference names) under the release's names, plus seeded values for the release
    tensors the pipeline leaves unread: the image embedder, the reference-image patch embedder and
    refiner (the noise refiner's shapes), the image index embedding."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        out[name if name.startswith(DECODER_PREFIX) else TRANSFORMER_PREFIX + name] = tensor
    generator = torch.Generator().manual_seed(seed + 7919)
    extra = unused_release_shapes(config)
    for name, tensor in state.items():
        if name.startswith("noise_refiner."):
            extra[TRANSFORMER_PREFIX + "ref_image_refiner." + name.removeprefix("noise_refiner.")] = tuple(tensor.shape)
    for name, shape in extra.items():
        out[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16).float()
    return out


# ---------------------------------------------------------------------------------------------
# The family's ReleaseLayout (registered under "dit" in reference_models/families.py)
# ---------------------------------------------------------------------------------------------


def parse_dit(data: Mapping[str, Any], source: str = CONFIG_FILE) -> ParsedConfig:
    """The DiT config of a release config.json (docs/model.md §10), or of parity's flat DiT one."""
    if not is_release_config(data):
        config = DiTConfig.from_json_dict(dict(data), source=source)
        fields = [f.name for f in dataclasses.fields(config) if f.name not in ("decoder", "name")]
        return ParsedConfig(config, {name: (getattr(config, name), name) for name in fields}, {})
    config, notes = config_from_release(data, source)
    given = data.get("gen_dit_config") or {}
    recognised: dict[str, tuple[Any, str]] = {}
    for field in dataclasses.fields(config):
        if field.name in ("decoder", "name"):
            continue
        if field.name == "text_feat_dim" and _llm_width(data) is not None:
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
    unused = tuple(TensorRule(prefix, None, reason) for prefix, reason in UNUSED_TENSORS if not prefix.startswith("llm_model."))
    return (
        *unused,  # the more specific prefixes first: they sit under gen_transformer.
        TensorRule(TRANSFORMER_PREFIX, ""),
        TensorRule(DECODER_PREFIX, DECODER_PREFIX, ""),
        # The release's VAE decodes (docs/model.md §10), unless parity's stand-in is present.
        TensorRule(VAE_PREFIX, VAE_PREFIX, ""),
    )


LAYOUT = ReleaseLayout(
    key="dit",
    config_keys=(
        "gen_dit_config",
        "gen_vae_config",
        "gen_axes_dim_rope",
        "gen_axes_lens",
        STAND_IN_DECODER_KEY,
        "llm_config",
    ),
    parse=parse_dit,
    rules=_dit_rules(),
)

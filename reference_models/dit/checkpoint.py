"""Random DiT checkpoints with upstream tensor names, and the reference's loader.

A checkpoint is an HF-style directory: `config.json` (DiTConfig.to_json_dict) plus
`model.safetensors`, or shards listed in `model.safetensors.index.json`. Tensor names are
upstream's (`x_embedder.*`, `time_caption_embed.*`, `context_refiner.N.*`, `noise_refiner.N.*`,
`layers.N.attn.to_q|to_k|to_v|to_out.0`, `attn.norm_q|norm_k`, `feed_forward.linear_1|2|3`,
`norm1.linear`, `norm2`, `ffn_norm1|2`, `norm_out.linear_1|2`), the decoder under
`vae_decoder.*`. Reference-image tensors (`ref_image_patch_embedder`, `ref_image_refiner`,
`image_index_embedding`) and the image-condition embedder are left out: text-to-image never reads
them. The release layout (`layout="release"`, `release.py`, docs/model.md §10) carries them, under
`gen_transformer.`, and the readers list them as unused.

Initialisation (docs/model.md §9, with one measured deviation): a seeded normal for every matrix
and every bias, `1 + normal(0, 0.1)` for norm weights, and no zero init anywhere (upstream
zero-initialises the adaLN linears and `norm_out`, which makes every modulated block the identity
and parity vacuous; zero biases and unit norm weights would hide a dropped, swapped or misapplied
bias or norm weight from every numeric suite). The matrices' std is 1/sqrt(fan_in) by default
rather than the AR backbone's flat 0.02: the two agree at the full width (1/sqrt(2520) = 0.0199),
but at the tiny width 0.02 leaves the blocks near-identity. Measured on tiny (seed 0, 32x32
latents, t = 0.3, with the former zero biases and unit norm weights): with 0.02 the adaLN gates are ~0.004, the
blocks move the velocity by 2.9% and 4 text tokens move it by 0.14% (below bf16 resolution),
and CFG 4.0 vs 1.0 changes the decoded image by 0.03 grey levels on average; with 1/sqrt(fan_in)
the same numbers are 38%, 1.7% and 2.0 levels. `matrix_std=0.02` gives the AR backbone's init.
A bias draws with its layer's matrix std (PyTorch's default `nn.Linear` bias has the same scale,
U(+-1/sqrt(fan_in))). Decoder convolutions always use 1/sqrt(fan_in), so the decoded image has
contrast. Every value is rounded to bf16, so fp64, fp32 and bf16 runs of one checkpoint hold
bit-identical weights and storing it in bf16 is lossless.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from reference_models.common.hf_checkpoint import check_floating, load_state_dict, read_json_object

from . import release
from .config import DiTConfig, config_for_size
from .decoder import LatentDecoder
from .model import Transformer2DModel

DECODER_PREFIX = "vae_decoder."
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
DEFAULT_SHARD_BYTES = 4 << 30


class CheckpointMismatchError(ValueError):
    """The tensors of a checkpoint do not fit the model: lists every offending name at once."""


def build_modules_on_meta(config: DiTConfig) -> tuple[Transformer2DModel, LatentDecoder]:
    with torch.device("meta"):
        return Transformer2DModel(config), LatentDecoder(config.decoder)


def expected_shapes(config: DiTConfig, *, decoder: bool = True) -> dict[str, torch.Size]:
    """Every checkpoint tensor name with its shape, in the order the modules declare them (without
    the stand-in decoder's when `decoder` is False: the release's VAE decodes)."""
    model, stand_in = build_modules_on_meta(config)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    if decoder:
        shapes.update({DECODER_PREFIX + name: p.shape for name, p in stand_in.named_parameters()})
    return shapes


NORM_SPREAD = 0.1  # norm weights: 1 + normal(0, NORM_SPREAD), within about 0.6..1.4


def _init_std(name: str, shape: torch.Size, shapes: Mapping[str, torch.Size], matrix_std: float | None) -> float | None:
    """The normal's std of a matrix or a bias (a bias takes its layer's weight's std); None for a
    norm weight (1-D, not a bias), which draws `1 + normal(0, NORM_SPREAD)`."""
    if name.endswith(".bias"):
        shape = shapes[name.removesuffix(".bias") + ".weight"]
    elif len(shape) == 1:
        return None
    fan_in = math.prod(shape[1:])
    if len(shape) == 4 or matrix_std is None:
        return 1.0 / math.sqrt(fan_in)
    return matrix_std


def random_state_dict(
    config: DiTConfig,
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    matrix_std: float | None = None,
) -> dict[str, torch.Tensor]:
    """The seeded random weights, generated on `device` (in-memory path for full size on a GPU).

    `matrix_std` None draws matrices with std 1/sqrt(fan_in); a float fixes it (0.02 = the AR
    init of docs/model.md §9).

    Deterministic per (seed, device type): one generator on `device` draws the tensors in
    `expected_shapes` order. A CUDA draw differs from a CPU draw of the same seed; both
    implementations must be given the same dict.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    shapes = expected_shapes(config)
    for name, shape in shapes.items():
        std = _init_std(name, shape, shapes, matrix_std)
        draw = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        value = 1.0 + NORM_SPREAD * draw if std is None else draw * std
        state[name] = value.to(torch.bfloat16).to(dtype)
    return state


def write_checkpoint(
    config: DiTConfig,
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    storage_dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write `config.json` and the tensors (sharded with an index above `max_shard_bytes`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME).write_text(json.dumps(config.to_json_dict(), indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu", storage_dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        return out
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = file_name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return out


def make_dit_checkpoint(
    size: str,
    seed: int,
    out_dir: str | Path,
    storage_dtype: torch.dtype | None = None,
    matrix_std: float | None = None,
    layout: str = "parity",
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a random DiT checkpoint of `size` ("tiny" or "full") to `out_dir`; return the dir.

    Stored fp32 for tiny and bf16 for full (lossless either way: the values are bf16-exact).
    The full size holds ~2.5e9 parameters (~5 GB in bf16) and takes minutes on a CPU.
    `layout="release"` writes the released composite model's layout instead (a top-level
    `config.json` with `gen_dit_config`, tensors under `gen_transformer.`, the release's unused
    DiT tensors included: `reference_models/dit/release.py`).
    """
    config = config_for_size(size)
    if storage_dtype is None:
        storage_dtype = torch.float32 if size == "tiny" else torch.bfloat16
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shard = DEFAULT_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes
    state = random_state_dict(config, seed, "cpu", torch.float32, matrix_std)
    if layout == "parity":
        return write_checkpoint(config, state, out_dir, storage_dtype, shard)
    if layout == "release":
        out = write_checkpoint(config, release.release_state_dict(config, state, seed), out_dir, storage_dtype, shard)
        (out / CONFIG_NAME).write_text(json.dumps(release.release_config_dict(config), indent=2) + "\n")
        return out
    raise ValueError(f"unknown checkpoint layout {layout!r}; expected 'parity' or 'release'")


@dataclasses.dataclass
class CheckpointReport:
    """What a checkpoint directory holds for the DiT: its layout, the config keys left unused and
    every tensor this pipeline does not read, with the reason (`parity inspect-checkpoint`), and
    which decoder decodes: parity's stand-in (`vae_decoder.*`) or the release's VAE (`gen_vae.*`,
    built from `vae_config`)."""

    layout: str  # "parity" or "release"
    unused_config: dict[str, str]
    unused_tensors: dict[str, str]
    decoder: str = "stand-in"  # or "release-vae"
    vae_config: dict | None = None


def read_checkpoint_report(checkpoint_dir: str | Path) -> tuple[DiTConfig, dict[str, torch.Tensor], CheckpointReport]:
    """`read_checkpoint` plus the report; a release layout is mapped onto the reference's names
    (with the release's VAE, its `gen_vae.*` tensors are among them, under those names)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"DiT checkpoint directory not found: {root}")
    data = _read_json(root / CONFIG_NAME)
    tensors = _read_tensors(root)
    if not release.is_release_config(data):
        return DiTConfig.from_json_dict(data, source=str(root / CONFIG_NAME)), tensors, CheckpointReport("parity", {}, {})
    config, notes = release.config_from_release(data, str(root / CONFIG_NAME))
    used, unused, vae = release.split_release_tensors(tensors)
    if not vae:
        if not any(name.startswith(DECODER_PREFIX) for name in used):
            raise CheckpointMismatchError(
                f"{root}: no decoder: neither the release's VAE (gen_vae.* tensors, built from gen_vae_config) nor "
                f"parity's stand-in decoder ({DECODER_PREFIX}*, written by make-checkpoint --layout release)"
            )
        return config, used, CheckpointReport("release", notes, unused)
    return (
        config,
        {**used, **vae},
        CheckpointReport("release", notes, unused, "release-vae", dict(data.get("gen_vae_config") or {})),
    )


def read_checkpoint(checkpoint_dir: str | Path) -> tuple[DiTConfig, dict[str, torch.Tensor]]:
    """Read `config.json` and every tensor (single file or index + shards) onto the CPU, in the
    parity layout or the release layout (mapped onto the reference's names)."""
    config, tensors, _ = read_checkpoint_report(checkpoint_dir)
    return config, tensors


def _read_json(path: Path) -> dict:
    try:
        return read_json_object(path)  # not UTF-8, not JSON, not an object: one line naming the file
    except FileNotFoundError:
        raise FileNotFoundError(f"DiT checkpoint config not found: {path}") from None


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory, found as docs/checkpoints.md §1 says for both families: the
    files every `*.safetensors.index.json` lists (an index wins over a `model.safetensors` beside
    it), else every `*.safetensors` file."""
    if not any(root.glob("*.safetensors.index.json")) and not any(root.glob("*.safetensors")):
        raise FileNotFoundError(f"{root}: neither {WEIGHTS_NAME} nor {INDEX_NAME} is present")
    return load_state_dict(root)


def check_tensors(expected: Mapping[str, torch.Size], found: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise CheckpointMismatchError naming every missing, unexpected and wrong-shaped tensor."""
    missing = [n for n in expected if n not in found]
    unexpected = sorted(n for n in found if n not in expected)
    wrong = [
        f"{n}: expected {tuple(expected[n])}, got {tuple(found[n].shape)}"
        for n in expected
        if n in found and tuple(found[n].shape) != tuple(expected[n])
    ]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            parts.append(f"unexpected ({len(unexpected)}): " + ", ".join(unexpected))
        if wrong:
            parts.append(f"wrong shape ({len(wrong)}): " + "; ".join(wrong))
        raise CheckpointMismatchError(f"DiT checkpoint {source} does not fit the model: " + "; ".join(parts))
    check_floating(found, f"DiT checkpoint {source}")

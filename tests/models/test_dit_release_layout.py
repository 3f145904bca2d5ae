"""The DiT side of the release checkpoint layout (docs/model.md §10): a parity-written release
directory is read by both implementations with the same tensors as the parity layout, every
release tensor is either loaded or listed as unused with its reason, and the release config's
`gen_dit_config` / `gen_vae_config` / `gen_axes_*` / LLM width decide the configuration."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference_models.checkpoints import make_checkpoint
from reference_models.dit import release
from reference_models.dit.adapter import ReferenceDiT
from reference_models.dit.checkpoint import CheckpointMismatchError, read_checkpoint_report
from reference_models.dit.config import DiTConfig
from serving_models.dit.adapter import ServingDiT
from serving_models.dit.config import DiTConfig as ServingDiTConfig
from serving_models.dit.weights import _release_config as serving_release_config
from tests.support.noise_checks import assert_same_state

LOADERS = {"reference": ReferenceDiT.load, "serving": ServingDiT.load}


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    parity = make_checkpoint("dit", "tiny", 3, tmp_path_factory.mktemp("parity"))
    released = make_checkpoint("dit", "tiny", 3, tmp_path_factory.mktemp("release"), layout="release")
    return parity, released


def edited(source: Path, target: Path, *, config=None, tensors=None) -> Path:
    """A copy of release directory `source` with its config and/or tensors changed by callables."""
    target.mkdir()
    data = json.loads((source / "config.json").read_text())
    state = load_file(str(source / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(config(data) if config else data))
    save_file(tensors(state) if tensors else state, str(target / "model.safetensors"))
    return target


def test_the_release_directory_has_the_release_layout(directories):
    _, released = directories
    data = json.loads((released / "config.json").read_text())
    assert {"gen_dit_config", "gen_vae_config", "gen_axes_dim_rope", "gen_axes_lens", "llm_config"} <= set(data)
    names = set(load_file(str(released / "model.safetensors")))
    assert "gen_transformer.x_embedder.weight" in names and "x_embedder.weight" not in names
    for unused in (
        "gen_transformer.time_caption_embed.image_embedder.query",
        "gen_transformer.ref_image_patch_embedder.weight",
        "gen_transformer.ref_image_refiner.0.attn.to_q.weight",
        "gen_transformer.image_index_embedding",
    ):
        assert unused in names


@pytest.mark.parametrize("implementation", LOADERS)
def test_both_layouts_load_the_same_tensors(directories, implementation):
    parity, released = directories
    from_parity, from_release = LOADERS[implementation](parity), LOADERS[implementation](released)
    assert_same_state(from_parity, from_release)
    assert dataclasses.replace(from_release.config, name="") == dataclasses.replace(from_parity.config, name="")
    x = torch.randn(1, 16, 32, 48, generator=torch.Generator().manual_seed(0))
    text, mask = from_parity.text_condition(7, seed=1)
    t = torch.tensor([0.4])
    # Same tensors at other file offsets: fp32 GEMM rounding by alignment (docs/machine-independence.md).
    torch.testing.assert_close(
        from_release.forward(x, t, text, mask), from_parity.forward(x, t, text, mask), atol=1e-5, rtol=1e-5
    )


def test_every_release_tensor_is_loaded_or_listed_with_a_reason(directories):
    _, released = directories
    config, used, report = read_checkpoint_report(released)
    assert report.layout == "release"
    names = set(load_file(str(released / "model.safetensors")))
    loaded = {n if n.startswith("vae_decoder.") else "gen_transformer." + n for n in used}
    assert loaded | set(report.unused_tensors) == names and not loaded & set(report.unused_tensors)
    assert all(report.unused_tensors.values())
    reasons = {name.split(".")[1] for name in report.unused_tensors}
    assert reasons == {"time_caption_embed", "ref_image_patch_embedder", "ref_image_refiner", "image_index_embedding"}
    assert "Q-Former" in report.unused_tensors["gen_transformer.time_caption_embed.image_embedder.query"]


def test_vae_and_llm_tensors_are_listed_and_strays_listed_and_never_read(directories, tmp_path):
    """Beside the stand-in decoder a VAE is listed unused; the AR's tensors are the AR family's; a
    tensor no family claims is listed and never read (docs/checkpoints.md §2), by both packages."""
    _, released = directories

    def add(state):
        return {
            **state,
            "gen_vae.decoder.conv_in.weight": torch.zeros(4, 16, 3, 3),
            "llm_model.lm_head.weight": torch.zeros(8, 4),
        }

    with_others = edited(released, tmp_path / "others", tensors=add)
    _, _, report = read_checkpoint_report(with_others)
    assert "AutoencoderKL" in report.unused_tensors["gen_vae.decoder.conv_in.weight"]
    assert "AR" in report.unused_tensors["llm_model.lm_head.weight"]
    for load in LOADERS.values():
        load(with_others)

    stray = edited(released, tmp_path / "stray", tensors=lambda s: {**s, "gen_other.weight": torch.zeros(2)})
    _, used, report = read_checkpoint_report(stray)
    assert "no model family claims" in report.unused_tensors["gen_other.weight"] and "gen_other.weight" not in used
    for load in LOADERS.values():
        assert_same_state(load(stray), load(released))
    # A name under the DiT's own prefix that the model does not have is still refused.
    unknown = edited(released, tmp_path / "unknown", tensors=lambda s: {**s, "gen_transformer.other.weight": torch.zeros(2)})
    with pytest.raises(CheckpointMismatchError, match="other.weight"):
        ReferenceDiT.load(unknown)
    with pytest.raises(ValueError, match="other.weight"):
        ServingDiT.load(unknown)


def test_a_release_directory_without_any_decoder_is_refused(directories, tmp_path):
    """Neither the release's VAE (gen_vae.*) nor the stand-in (vae_decoder.*): one line naming both."""
    _, released = directories
    bare = edited(released, tmp_path / "bare", tensors=lambda s: {k: v for k, v in s.items() if not k.startswith("vae_decoder.")})
    for load in LOADERS.values():
        with pytest.raises(ValueError, match=r"no decoder: neither the release's VAE \(gen_vae\.\*.*vae_decoder\.\*"):
            load(bare)


def test_the_release_config_decides_widths_tables_and_decoder_factors():
    """The LLM width re-creates the caption embedder, gen_dit_config's axes_lens (here absent: the
    diffusers default) are the RoPE tables and the composite's gen_axes_lens are listed as ignored
    (docs/model.md §10), gen_vae_config gives the decoder factors, and absent DiT keys take
    upstream's defaults."""
    data = {
        "llm_config": {"text_config": {"hidden_size": 48}},
        "gen_dit_config": {
            "_class_name": "Transformer2DModel",
            "_diffusers_version": "0.35.1",
            "hidden_size": 96,
            "num_attention_heads": 4,
            "num_kv_heads": 2,
            "axes_dim_rope": [12, 6, 6],
            "multiple_of": 16,
            "num_layers": 1,
            "num_refiner_layers": 1,
            "text_feat_dim": 1024,
            "is_image_embedder": False,
        },
        "gen_vae_config": {"latent_channels": 16, "scaling_factor": 0.5, "shift_factor": 0.25},
        "gen_axes_dim_rope": [12, 6, 6],
        "gen_axes_lens": [64, 64, 64],
        "gen_condition_mode": "text_image",
    }
    config, notes = release.config_from_release(data, "test")
    assert (config.text_feat_dim, config.axes_lens, config.in_channels, config.timestep_scale) == (48, (300, 512, 512), 16, 1.0)
    assert (config.decoder.scaling_factor, config.decoder.shift_factor) == (0.5, 0.25)
    assert {"gen_dit_config.text_feat_dim", "gen_axes_lens", "gen_condition_mode", "is_image_embedder"} <= set(notes)
    # The serving port reads the same configuration from the same dict.
    served = serving_release_config(data, "test")
    assert served == ServingDiTConfig.coerce(config.to_json_dict() | {"_parity_config_name": served.name})


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d | {"gen_axes_dim_rope": [8, 8, 8]}, "gen_axes_dim_rope"),
        (lambda d: d | {"gen_dit_config": d["gen_dit_config"] | {"norm_eps": 1e-6}}, "norm_eps"),
        (lambda d: d | {"gen_dit_config": d["gen_dit_config"] | {"rope_scale": 2}}, "rope_scale"),
    ],
    ids=["axes-contradiction", "caption-eps", "unknown-key"],
)
def test_contradictions_are_refused_by_both(directories, tmp_path, change, message):
    _, released = directories
    broken = edited(released, tmp_path / "broken", config=change)
    for load in LOADERS.values():
        with pytest.raises(ValueError, match=message):
            load(broken)


def test_the_parity_layout_reader_cannot_read_a_release_directory(directories):
    """Why the release path exists: the parity config reader refuses the release config."""
    _, released = directories
    with pytest.raises(ValueError, match="missing key 'vae_decoder'"):
        DiTConfig.from_file(released / "config.json")


def test_a_release_tensor_without_a_reason_is_refused(directories, monkeypatch):
    """The listing is complete by construction: a release tensor that is neither a model tensor nor
    explained by a prefix is an error, shown by dropping the image embedder's entry."""
    _, released = directories
    kept = tuple(entry for entry in release.UNUSED_TENSORS if "image_embedder" not in entry[0])
    monkeypatch.setattr(release, "UNUSED_TENSORS", kept)
    with pytest.raises(CheckpointMismatchError, match="unexpected.*time_caption_embed.image_embedder.query"):
        ReferenceDiT.load(released)

"""A released directory's DiT decodes with its own VAE (docs/model.md §10): diffusers'
`AutoencoderKL` built from `gen_vae_config` with the `gen_vae.*` tensors, in both packages.

The directory is parity's tiny release-layout DiT with the stand-in decoder swapped for a tiny
seeded AutoencoderKL (the release's shape of VAE: 16 latent channels, 8x upsampling, a shift
factor, no quant convs). Both implementations must decode exactly as diffusers does, on the release
pipeline's path (`latents / scaling + shift`, `decode`, diffusers' postprocessing); a decoder that
drops the shift or keeps the stand-in's tanh is shown to fail the same comparison. diffusers is in
the `test` extra, so CI runs these; without it they skip with that reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parity.cli import main
from reference_models.checkpoints import make_checkpoint
from reference_models.dit.adapter import ReferenceDiT
from reference_models.dit.checkpoint import read_checkpoint_report
from serving_models.dit.adapter import ServingDiT

diffusers = pytest.importorskip("diffusers", reason="the release's VAE needs diffusers: pip install 'parity[vae]'")

VAE_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [8, 8, 16, 16],
    "layers_per_block": 1,
    "act_fn": "silu",
    "latent_channels": 16,
    "norm_num_groups": 4,
    "sample_size": 64,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
LOADERS = {"reference": ReferenceDiT.load, "serving": ServingDiT.load}


def tiny_vae() -> torch.nn.Module:
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(**VAE_CONFIG).eval()
    with torch.no_grad():  # diffusers' init leaves norms at 1 / 0: draw them so every tensor matters
        for name, param in vae.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "conv_norm_out.weight", "group_norm.weight")):
                param.add_(0.1 * torch.randn_like(param))
    return vae


def with_vae(source: Path, target: Path, vae: torch.nn.Module, *, keep_stand_in: bool = False, drop: str = "") -> Path:
    """A copy of a parity-written release directory whose decoder is `vae` (gen_vae.*, gen_vae_config)."""
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    if not keep_stand_in:
        config.pop("parity_stand_in_decoder")
        tensors = {n: t for n, t in tensors.items() if not n.startswith("vae_decoder.")}
    config["gen_vae_config"] = {"_class_name": "AutoencoderKL", "_diffusers_version": diffusers.__version__, **VAE_CONFIG}
    tensors.update({"gen_vae." + n: t.contiguous() for n, t in vae.state_dict().items() if n != drop})
    (target / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(target / "model.safetensors"))
    return target


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("release-vae")
    parity_written = make_checkpoint("dit", "tiny", 3, root / "parity-written", layout="release")
    vae = tiny_vae()
    return parity_written, with_vae(parity_written, root / "released", vae), vae


def diffusers_decode(vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """What the release's pipeline produces: diffusers' decode and image postprocessing, uint8 [B, H, W, 3]."""
    with torch.no_grad():
        image = vae.decode(latents / VAE_CONFIG["scaling_factor"] + VAE_CONFIG["shift_factor"]).sample
    from diffusers.image_processor import VaeImageProcessor

    processed = VaeImageProcessor().postprocess(image, output_type="np")  # [B, H, W, 3] in [0, 1]
    return torch.from_numpy((processed * 255).round().astype("uint8"))


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    return torch.randn(2, 16, 4, 6, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("implementation", LOADERS)
def test_both_implementations_decode_exactly_as_diffusers(release, latents, implementation: str) -> None:
    _, released, vae = release
    adapter = LOADERS[implementation](released)
    expected = diffusers_decode(vae, latents)
    decoded = adapter.decode(latents)
    assert decoded.dtype == torch.uint8 and tuple(decoded.shape) == (2, 32, 48, 3)
    assert torch.equal(decoded, expected)


def test_the_comparison_sees_a_dropped_shift_and_the_stand_in_postprocessing(release, latents) -> None:
    """Broken decoders a port writes: the shift factor left out, the stand-in's tanh kept."""
    _, released, vae = release
    expected = diffusers_decode(vae, latents)
    adapter = ReferenceDiT.load(released)
    adapter.decoder.shift_factor = 0.0
    assert not torch.equal(adapter.decode(latents), expected)
    adapter = ReferenceDiT.load(released)
    with torch.no_grad():
        image = adapter.decoder.vae.decode(latents / VAE_CONFIG["scaling_factor"] + VAE_CONFIG["shift_factor"]).sample
    tanh = ((torch.tanh(image) + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    assert not torch.equal(tanh, expected)


def test_generate_runs_through_the_release_vae_in_both(release) -> None:
    _, released, _ = release
    reference, serving = ReferenceDiT.load(released), ServingDiT.load(released)
    text, mask = reference.text_condition(5, seed=2)
    images = [a.generate(text, mask, 4, 4, steps=2, guidance_scale=4.0, seed=1) for a in (reference, serving)]
    assert all(i.dtype == torch.uint8 and tuple(i.shape) == (1, 32, 32, 3) for i in images)
    # The two samplers differ by fp32 summation order only (docs/model.md §8): a level at most.
    assert int((images[0].int() - images[1].int()).abs().max()) <= 1


def test_the_report_and_inspect_checkpoint_say_which_decoder_decodes(release, tmp_path, capsys, monkeypatch) -> None:
    parity_written, released, vae = release
    _, used, report = read_checkpoint_report(released)
    assert report.decoder == "release-vae" and report.vae_config["latent_channels"] == 16
    assert "gen_vae.decoder.conv_in.weight" in used and not any(n.startswith("gen_vae.") for n in report.unused_tensors)
    monkeypatch.chdir(tmp_path)
    assert main(["inspect-checkpoint", str(released)]) == 0
    out = capsys.readouterr().out
    assert "decodes with ReleaseVAEDecoder" in out and "decodes with VAEDecoder" in out
    # Beside parity's stand-in the VAE is listed, not read: the stand-in decodes.
    both = with_vae(parity_written, tmp_path / "both", vae, keep_stand_in=True)
    _, _, report = read_checkpoint_report(both)
    assert report.decoder == "stand-in" and "stand-in decoder" in report.unused_tensors["gen_vae.decoder.conv_in.weight"]
    assert type(ServingDiT.load(both).decoder).__name__ == "LatentDecoder"


@pytest.mark.parametrize("implementation", LOADERS)
def test_a_missing_vae_tensor_is_one_line_naming_it(release, tmp_path, implementation: str) -> None:
    parity_written, _, vae = release
    broken = with_vae(parity_written, tmp_path / "broken", vae, drop="decoder.conv_in.weight")
    with pytest.raises(ValueError, match="gen_vae.decoder.conv_in.weight") as info:
        LOADERS[implementation](broken)
    assert "\n" not in str(info.value)

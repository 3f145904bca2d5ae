"""DiT checkpoints: upstream names, the init of docs/model.md §9, round trip, sharding, loading errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from parity.compare import Tolerance
from reference_models.dit.adapter import ReferenceDiT
from reference_models.dit.checkpoint import (
    CheckpointMismatchError,
    expected_shapes,
    make_dit_checkpoint,
    random_state_dict,
    write_checkpoint,
)
from reference_models.dit.config import full_config, tiny_config
from serving_models.dit.adapter import ServingDiT
from serving_models.dit.weights import CheckpointMismatchError as ServingMismatchError
from tests.support.dit_support import latents, tiny_state
from tests.support.noise_checks import assert_same_state, assert_within_noise_floor

ADAPTERS = [ReferenceDiT, ServingDiT]
# A loaded model's tensors sit at other memory alignments than a built one's, and CPU GEMM kernels
# round by alignment (reproduced here with MKL_ENABLE_INSTRUCTIONS=SSE4_2: 1.4e-6 apart), so the
# two forwards are judged by the noise-floor rule; the pre-check is the DiT's fp32 bound.
FORWARD_TOL = Tolerance(
    1e-5, 1e-5, "fp32 accumulation order of the same model's GEMMs (cases/dit.toml serving_vs_reference_fp32)"
)


def check_round_trip(cls, directory, state, x, t, text_len: int) -> None:
    """The loaded model holds the state's tensors bitwise; its forward equals the built one's
    within the fp32 noise floor (against an fp64 build of the same state)."""
    loaded, built = cls.load(directory), cls.build(tiny_config(), state)
    assert_same_state(loaded, built)
    golden = cls.build(tiny_config(), state, dtype=torch.float64)
    text, mask = loaded.text_condition(text_len, seed=0)
    want = golden.forward(x.double(), t.double(), text.double(), mask)
    assert_within_noise_floor(
        want,
        built.forward(x, t, text, mask),
        loaded.forward(x, t, text, mask),
        FORWARD_TOL,
        name=f"{cls.__name__} loaded vs built",
    )


def test_tensor_names_are_upstream_names():
    names = set(expected_shapes(tiny_config()))
    for name in [
        "x_embedder.weight",
        "x_embedder.bias",
        "time_caption_embed.timestep_embedder.linear_1.weight",
        "time_caption_embed.timestep_embedder.linear_2.bias",
        "time_caption_embed.caption_embedder.0.weight",
        "time_caption_embed.caption_embedder.1.weight",
        "context_refiner.0.attn.to_q.weight",
        "context_refiner.0.norm1.weight",
        "noise_refiner.0.norm1.linear.weight",
        "noise_refiner.0.norm1.norm.weight",
        "layers.1.attn.to_k.weight",
        "layers.1.attn.to_v.weight",
        "layers.1.attn.to_out.0.weight",
        "layers.1.attn.norm_q.weight",
        "layers.1.attn.norm_k.weight",
        "layers.1.feed_forward.linear_1.weight",
        "layers.1.feed_forward.linear_2.weight",
        "layers.1.feed_forward.linear_3.weight",
        "layers.1.norm2.weight",
        "layers.1.ffn_norm1.weight",
        "layers.1.ffn_norm2.weight",
        "norm_out.linear_1.weight",
        "norm_out.linear_2.bias",
        "vae_decoder.conv_in.weight",
        "vae_decoder.up_convs.2.weight",
        "vae_decoder.conv_out.bias",
    ]:
        assert name in names, name
    assert not any("bias" in n and ".attn." in n for n in names)  # attention and FFN have no bias
    assert not any("feed_forward" in n and n.endswith("bias") for n in names)


def test_full_shapes_on_meta():
    shapes = expected_shapes(full_config())
    assert shapes["layers.19.attn.to_k.weight"] == (7 * 120, 2520)
    assert shapes["layers.0.norm1.linear.weight"] == (4 * 2520, 1024)
    assert shapes["layers.0.feed_forward.linear_1.weight"] == (10240, 2520)
    assert shapes["time_caption_embed.caption_embedder.1.weight"] == (2520, 3584)
    assert shapes["norm_out.linear_2.weight"] == (2 * 2 * 16, 2520)
    assert "layers.20.attn.to_q.weight" not in shapes and "context_refiner.1.norm1.weight" in shapes


def test_init_overrides_upstream_zero_inits_and_is_bf16_exact():
    state = tiny_state()
    for name, value in state.items():
        if name.endswith(".bias"):  # drawn with the layer's matrix std: a dropped bias shows
            weight = state[name.removesuffix(".bias") + ".weight"]
            assert value.std() > 0.2 * weight.std(), name
        elif value.ndim == 1:  # norm weights 1 + normal(0, 0.1): a swapped or dropped weight shows
            assert value.min() > 0.5 and value.max() < 1.5 and value.std() > 0.03, name
        else:
            assert value.std() > 0.01, name  # no zero init (adaLN, norm_out included)
        assert torch.equal(value, value.to(torch.bfloat16).float()), name
    norms = torch.cat([v for n, v in state.items() if v.ndim == 1 and not n.endswith(".bias")])
    assert norms.mean().item() == pytest.approx(1.0, abs=0.01) and norms.std().item() == pytest.approx(0.1, rel=0.1)
    # Matrices: std 1/sqrt(fan_in) by default; matrix_std=0.02 is the AR backbone's rule.
    assert state["layers.0.attn.to_q.weight"].std().item() == pytest.approx(96**-0.5, rel=0.05)
    literal = random_state_dict(tiny_config(), 0, matrix_std=0.02)
    assert literal["layers.0.attn.to_q.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert literal["vae_decoder.conv_in.weight"].std().item() == pytest.approx((16 * 9) ** -0.5, rel=0.1)


def test_random_state_dict_is_seeded():
    a, b = random_state_dict(tiny_config(), 5), random_state_dict(tiny_config(), 5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = random_state_dict(tiny_config(), 6)
    assert not torch.equal(a["layers.0.attn.to_q.weight"], c["layers.0.attn.to_q.weight"])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_dit_checkpoint("tiny", 0, tmp_path_factory.mktemp("dit") / "tiny")


def test_checkpoint_round_trip(tiny_dir):
    assert (tiny_dir / "config.json").is_file() and (tiny_dir / "model.safetensors").is_file()
    assert json.loads((tiny_dir / "config.json").read_text())["hidden_size"] == 96
    stored = load_file(str(tiny_dir / "model.safetensors"))
    state = tiny_state()
    assert stored.keys() == state.keys() and all(torch.equal(stored[k], state[k]) for k in state)
    x, t = latents((1, 16, 32, 32)), torch.tensor([0.5])
    for cls in ADAPTERS:
        check_round_trip(cls, tiny_dir, state, x, t, text_len=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_load_in_other_dtypes(tiny_dir, dtype):
    for cls in ADAPTERS:
        adapter = cls.load(tiny_dir, dtype=dtype)
        assert {p.dtype for p in adapter.module.parameters()} == {dtype}
        text, mask = adapter.text_condition(4, seed=0)
        assert adapter.forward(latents((1, 16, 16, 16)), torch.tensor([0.5]), text, mask).dtype == dtype


def test_sharded_checkpoint_round_trip(tmp_path):
    state = tiny_state()
    out = write_checkpoint(tiny_config(), state, tmp_path / "sharded", max_shard_bytes=400_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    x, t = latents((1, 16, 16, 16)), torch.tensor([0.5])
    for cls in ADAPTERS:
        check_round_trip(cls, out, state, x, t, text_len=3)


@pytest.mark.parametrize("cls,error", [(ReferenceDiT, CheckpointMismatchError), (ServingDiT, ServingMismatchError)])
def test_loading_names_every_missing_unexpected_and_wrong_shaped_tensor(tmp_path, cls, error):
    state = dict(tiny_state())
    del state["layers.1.attn.to_v.weight"]
    del state["vae_decoder.conv_out.bias"]
    state["layers.1.attn.to_v.bias"] = torch.zeros(48)
    state["noise_refiner.0.norm1.linear.weight"] = torch.zeros(384, 95)
    write_checkpoint(tiny_config(), state, tmp_path)
    with pytest.raises(error) as info:
        cls.load(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "missing (2): layers.1.attn.to_v.weight, vae_decoder.conv_out.bias" in message
    assert "unexpected (1): layers.1.attn.to_v.bias" in message
    assert "noise_refiner.0.norm1.linear.weight: expected (384, 96), got (384, 95)" in message
    with pytest.raises(error, match="in-memory state dict"):
        cls.build(tiny_config(), state)


@pytest.mark.parametrize("cls", ADAPTERS)
def test_loading_errors_for_missing_files(tmp_path, cls):
    with pytest.raises(FileNotFoundError, match="not found"):
        cls.load(tmp_path / "nowhere")
    write_checkpoint(tiny_config(), {}, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        cls.load(tmp_path)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        cls.load(tmp_path)

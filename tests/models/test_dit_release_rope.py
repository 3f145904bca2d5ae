"""RoPE table lengths of a release directory and the padded text length (docs/model.md §7, §10).

Upstream's text-to-image path builds the transformer's RoPE tables from `gen_dit_config.axes_lens`,
not from the composite config's `gen_axes_lens`: a release directory whose `gen_axes_lens` are
short must still run a text that fits `gen_dit_config.axes_lens` (reading the wrong key refuses
it), in both packages. And the serving DiT bounds the real text length, not the padded one: 200
slots holding 5 real tokens run on 128-row tables, as the reference and upstream run them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reference_models.checkpoints import make_checkpoint
from reference_models.dit.adapter import ReferenceDiT
from reference_models.dit.release import config_from_release
from serving_models.dit.adapter import ServingDiT
from serving_models.dit.weights import _release_config as serving_release_config

LOADERS = {"reference": ReferenceDiT.load, "serving": ServingDiT.load}


@pytest.fixture(scope="module")
def short_gen_axes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A release directory with gen_dit_config.axes_lens (128, 128, 128) and gen_axes_lens (8, 8, 8)."""
    directory = make_checkpoint("dit", "tiny", 1, tmp_path_factory.mktemp("rope") / "release", layout="release")
    config = json.loads((directory / "config.json").read_text())
    assert config["gen_dit_config"]["axes_lens"] == [128, 128, 128]
    config["gen_axes_lens"] = [8, 8, 8]
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_tables_come_from_gen_dit_config_in_both_readers(short_gen_axes) -> None:
    data = json.loads((short_gen_axes / "config.json").read_text())
    config, notes = config_from_release(data, "config.json")
    assert config.axes_lens == (128, 128, 128) and "gen_axes_lens" in notes
    assert serving_release_config(data, "config.json").axes_lens == (128, 128, 128)
    without = {k: v for k, v in data.items() if k != "gen_axes_lens"} | {
        "gen_dit_config": {k: v for k, v in data["gen_dit_config"].items() if k != "axes_lens"}
    }
    assert config_from_release(without, "c")[0].axes_lens == (300, 512, 512)  # diffusers' default when absent
    assert serving_release_config(without, "c").axes_lens == (300, 512, 512)


@pytest.mark.parametrize("implementation", LOADERS)
def test_a_text_longer_than_gen_axes_lens_runs(short_gen_axes, implementation: str) -> None:
    """40 text tokens fit gen_dit_config's 128-row tables; tables from gen_axes_lens (8) would refuse them."""
    adapter = LOADERS[implementation](short_gen_axes)
    text, mask = adapter.text_condition(40, seed=4)
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    velocity = adapter.forward(x, torch.tensor([0.3]), text, mask)
    assert velocity.shape == x.shape and torch.isfinite(velocity).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[ReferenceDiT, ServingDiT]:
    directory = make_checkpoint("dit", "tiny", 2, tmp_path_factory.mktemp("tiny") / "parity")
    return ReferenceDiT.load(directory), ServingDiT.load(directory)


def _padded(adapter: ReferenceDiT, length: int, real: int) -> tuple[torch.Tensor, ...]:
    """One sample: `length` text slots of which the first `real` are tokens, 8x8 latents."""
    states, mask = adapter.text_condition(length, seed=6)
    mask[:, real:] = False
    return torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0.5]), states, mask


def test_serving_accepts_a_padded_text_length_above_axes_lens_when_the_real_one_fits(tiny) -> None:
    reference, serving = tiny
    assert serving.config.axes_lens == (128, 128, 128)
    inputs = _padded(reference, 200, 5)
    # fp32 summation-order noise of the two implementations (cases/dit.toml, serving_vs_reference_fp32)
    torch.testing.assert_close(serving.forward(*inputs), reference.forward(*inputs), atol=1e-5, rtol=1e-5)


def test_the_padded_length_check_refuses_what_upstream_accepts(tiny, monkeypatch) -> None:
    """The broken variant: the padded length bounded by the tables (the serving check before)."""
    reference, serving = tiny

    def padded_length_check(self, text_mask, grid_h, grid_w) -> None:
        if text_mask.shape[1] > min(self.config.axes_lens):
            raise ValueError("text length exceeds axes_lens (padded length)")

    monkeypatch.setattr(type(serving.module), "_check_positions", padded_length_check)
    with pytest.raises(ValueError, match="padded length"):
        serving.forward(*_padded(reference, 200, 5))


def test_both_refuse_a_real_text_past_the_tables_however_it_is_padded(tiny) -> None:
    reference, serving = tiny
    inputs = _padded(reference, 200, 150)
    with pytest.raises(RuntimeError, match="real text length of 128 tokens or more"):
        serving.forward(*inputs)
    with pytest.raises(ValueError, match="outside axes_lens"):
        reference.forward(*inputs)

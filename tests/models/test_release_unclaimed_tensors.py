"""A release tensor no model family claims is listed and never read (docs/checkpoints.md §2):
the built-in target and the reference load a release directory past it, AR and DiT alike, and
`inspect-checkpoint` lists it. In parity's own layout the same name is refused as unexpected. The
broken variant (the serving AR reading every name it does not know, as it did) refuses the release."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parity.cli import main
from reference_models.checkpoints import make_checkpoint
from tests.support.noise_checks import assert_same_state

EXTRA = {"gen_image_condition_refiner.proj.weight": torch.zeros(4, 4), "some_other_stage.weight": torch.zeros(3)}


def _loaders(kind: str) -> dict:
    from reference_models.ar.adapter import ReferenceARAdapter
    from reference_models.dit.adapter import ReferenceDiT
    from serving_models.target import make_target

    if kind == "ar":
        return {"reference": ReferenceARAdapter.load, "serving": lambda d: make_target().load_ar(d, "cpu", torch.float32)}
    return {"reference": ReferenceDiT.load, "serving": lambda d: make_target().load_dit(d, "cpu", torch.float32)}


@pytest.fixture(scope="module", params=["ar", "dit"])
def directories(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    root = tmp_path_factory.mktemp(f"unclaimed-{request.param}")
    plain = make_checkpoint(request.param, "tiny", 0, root / "plain", layout="release")
    extra = make_checkpoint(request.param, "tiny", 0, root / "extra", layout="release")
    save_file({**load_file(str(extra / "model.safetensors")), **EXTRA}, str(extra / "model.safetensors"))
    return request.param, plain, extra


def test_both_implementations_load_past_unclaimed_tensors(directories) -> None:
    kind, plain, extra = directories
    for load in _loaders(kind).values():
        assert_same_state(load(extra), load(plain))


def test_inspect_checkpoint_lists_them(directories, capsys, tmp_path, monkeypatch) -> None:
    kind, _, extra = directories
    monkeypatch.chdir(tmp_path)
    assert main(["inspect-checkpoint", str(extra)]) == 0
    out = capsys.readouterr().out
    assert "tensors no family claims (2): gen_image_condition_refiner.proj.* (1), some_other_stage.weight.* (1)" in out


def test_the_serving_ar_reading_unknown_names_refuses_the_release(directories, monkeypatch) -> None:
    kind, _, extra = directories
    if kind != "ar":
        pytest.skip("the variant is the serving AR's loader")
    from serving_models.ar import weights

    original = weights.local_checkpoint_name
    monkeypatch.setattr(weights, "local_checkpoint_name", lambda name, release=False: original(name))
    with pytest.raises(ValueError, match="unexpected 1 tensor"):
        _loaders("ar")["serving"](extra)

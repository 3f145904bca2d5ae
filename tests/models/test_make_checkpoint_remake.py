"""Remaking a checkpoint into the same directory (docs/checkpoints.md §5): the new
weight files replace the old ones as a whole, so both loaders of each family read exactly the new
checkpoint whatever the shard sizes before and after. The broken variant (writing in place, as
`make-checkpoint` did) leaves an old index or `model.safetensors` that the loaders read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity.cli import main
from reference_models.checkpoints import MAKERS
from tests.support.noise_checks import assert_same_state


def _loaders(kind: str) -> dict:
    from reference_models.ar.adapter import ReferenceARAdapter
    from reference_models.dit.adapter import ReferenceDiT
    from serving_models.target import make_target

    if kind == "ar":
        return {"reference": ReferenceARAdapter.load, "serving": lambda d: make_target().load_ar(d, "cpu", torch.float32)}
    return {"reference": ReferenceDiT.load, "serving": lambda d: make_target().load_dit(d, "cpu", torch.float32)}


def _weight_files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith((".safetensors", ".safetensors.index.json"))}


def _make(kind: str, directory: Path, seed: int, shard: int | None, capsys) -> str:
    args = ["make-checkpoint", kind, str(directory), "--seed", str(seed)] + (["--max-shard-bytes", str(shard)] if shard else [])
    assert main(args) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("kind", ["ar", "dit"])
@pytest.mark.parametrize(
    "first, second",
    [(20_000, None), (None, 20_000), (20_000, 60_000)],
    ids=["sharded-then-single", "single-then-sharded", "other-shard-size"],
)
def test_a_remade_directory_holds_only_the_new_checkpoint(kind, first, second, tmp_path, capsys) -> None:
    directory, fresh = tmp_path / "ckpt", tmp_path / "fresh"
    _make(kind, directory, 1, first, capsys)
    before = _weight_files(directory)
    out = _make(kind, directory, 2, second, capsys)
    _make(kind, fresh, 2, second, capsys)
    assert _weight_files(directory) == _weight_files(fresh)
    removed = before - _weight_files(directory)
    assert (
        f"removed the earlier checkpoint's weight files the new one does not have: {', '.join(sorted(removed))}" in out
    ) == bool(removed)
    for load in _loaders(kind).values():
        assert_same_state(load(directory), load(fresh))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging directory left


@pytest.mark.parametrize("kind", ["ar", "dit"])
def test_writing_in_place_leaves_files_the_loaders_read(kind, tmp_path) -> None:
    """The broken variant: the maker writes into the directory as it is."""
    directory, fresh = tmp_path / "ckpt", tmp_path / "fresh"
    MAKERS[kind]("tiny", 1, directory, max_shard_bytes=20_000)
    MAKERS[kind]("tiny", 2, directory)
    MAKERS[kind]("tiny", 2, fresh)
    stale = _weight_files(directory) - _weight_files(fresh)
    assert stale  # the old index and shards are still there
    with pytest.raises(AssertionError):
        for load in _loaders(kind).values():  # the index wins: seed 1's weights are read
            assert_same_state(load(directory), load(fresh))

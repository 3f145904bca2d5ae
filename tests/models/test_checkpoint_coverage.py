"""Weight coverage: a parameter loaded but never used is visible; fused parameters attribute to both halves."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from parity.observe.weight_reads import CheckpointError, coverage, group_by_prefix, list_tensors


class TwoExperts(torch.nn.Module):
    def __init__(self, use_gen: bool = True):
        super().__init__()
        self.und = torch.nn.Linear(4, 4, bias=False)
        self.gen = torch.nn.Linear(4, 4, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(4))
        self.use_gen = use_gen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.norm
        return self.gen(x) if self.use_gen else self.und(x)


def test_every_read_parameter_is_seen_including_through_views() -> None:
    model = TwoExperts()
    result = coverage(model, ["und.weight", "gen.weight", "norm"], [lambda: model(torch.ones(2, 4))])
    assert result.read == {"gen.weight", "norm"} and result.unused == ["und.weight"]
    model.use_gen = False
    result = coverage(model, ["und.weight", "gen.weight", "norm"], [lambda: model(torch.ones(2, 4))])
    assert result.unused == ["gen.weight"] and result.fraction == pytest.approx(2 / 3)


def test_a_fused_parameter_counts_for_every_checkpoint_tensor_it_holds() -> None:
    class Fused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = torch.nn.Linear(4, 8, bias=False)

        def forward(self, x):
            gate, up = self.gate_up(x).chunk(2, -1)
            return gate * up

    model = Fused()
    name_map = {"gate_up.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"]}.__getitem__
    names = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    result = coverage(model, names, [lambda: model(torch.ones(1, 4))], name_map)
    assert result.unused == ["mlp.down_proj.weight"] and result.unattributed == ()


def test_list_tensors_reads_single_and_sharded_checkpoints(tmp_path) -> None:
    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    entries = list_tensors(tmp_path)
    assert entries["a"].shape == (2, 3) and entries["b"].dtype == "BF16"

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a": torch.zeros(1)}, sharded / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(1)}, sharded / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(list_tensors(sharded)) == ["a", "b"]
    index["weight_map"]["c"] = "model-00003-of-00003.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="names shards that do not exist"):
        list_tensors(sharded)


def test_an_empty_directory_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        list_tensors(tmp_path)


def test_group_by_prefix_summarises_a_gap() -> None:
    names = [f"model.layers.{i}.gen_mlp.{p}_proj.weight" for i in (2, 3) for p in ("gate", "up", "down")]
    assert group_by_prefix(names) == {"model.layers.2.gen_mlp": 3, "model.layers.3.gen_mlp": 3}

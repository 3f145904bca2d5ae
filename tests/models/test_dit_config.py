"""DiT configurations: the shapes of docs/model.md §9, the head_dim == sum(axes) invariant, JSON I/O."""

from __future__ import annotations

import dataclasses

import pytest

from reference_models.dit.config import DiTConfig, config_for_size, full_config, tiny_config
from serving_models.dit.config import DiTConfig as ServingDiTConfig


def test_tiny_matches_spec_6_1():
    c = tiny_config()
    assert (c.hidden_size, c.num_attention_heads, c.num_kv_heads, c.head_dim) == (96, 4, 2, 24)
    assert (c.axes_dim_rope, c.axes_lens) == ((12, 6, 6), (128, 128, 128))
    assert (c.patch_size, c.in_channels, c.out_channels) == (2, 16, 16)
    assert (c.num_layers, c.num_refiner_layers, c.ffn_inner_dim, c.norm_eps) == (2, 1, 384, 1e-5)
    assert (c.text_feat_dim, c.timestep_scale, c.temb_dim) == (64, 1.0, 96)


def test_full_matches_spec_6_2():
    c = full_config()
    assert (c.hidden_size, c.num_attention_heads, c.num_kv_heads, c.head_dim) == (2520, 21, 7, 120)
    assert c.axes_dim_rope == (40, 40, 40)
    assert (c.ffn_inner_dim, c.temb_dim, c.text_feat_dim) == (10240, 1024, 3584)
    # ~2.5e9 transformer parameters with the (unconfirmed) 20 layers and 2 refiners.
    assert 2.4e9 < c.num_parameters() < 2.6e9


@pytest.mark.parametrize("config_cls", [DiTConfig, ServingDiTConfig], ids=["reference", "serving"])
def test_head_dim_must_equal_sum_of_rope_axes(config_cls):
    with pytest.raises(ValueError, match=r"hidden_size / num_attention_heads .*24.* sum\(axes_dim_rope\).*22"):
        config_cls(axes_dim_rope=(12, 6, 4))


@pytest.mark.parametrize("config_cls", [DiTConfig, ServingDiTConfig], ids=["reference", "serving"])
def test_heads_must_divide_hidden_and_kv_heads_divide_heads(config_cls):
    with pytest.raises(ValueError, match="not divisible by num_attention_heads 5"):
        config_cls(num_attention_heads=5)
    with pytest.raises(ValueError, match="multiple of num_kv_heads 3"):
        config_cls(num_kv_heads=3)


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_json_round_trip_is_read_identically_by_both_packages(size):
    config = config_for_size(size)
    data = config.to_json_dict()
    assert DiTConfig.from_json_dict(data) == config
    served = ServingDiTConfig.from_json_dict(data)
    for f in dataclasses.fields(ServingDiTConfig):
        if f.name != "decoder":
            assert getattr(served, f.name) == getattr(config, f.name), f.name
    assert dataclasses.asdict(served.decoder) == dataclasses.asdict(config.decoder)
    assert ServingDiTConfig.coerce(config) == served


@pytest.mark.parametrize("config_cls", [DiTConfig, ServingDiTConfig], ids=["reference", "serving"])
def test_unknown_and_missing_keys_are_named(config_cls):
    data = tiny_config().to_json_dict()
    data["hiden_size"] = data.pop("hidden_size")
    with pytest.raises(ValueError, match=r"unknown keys \['hiden_size'\].*missing keys \['hidden_size'\]"):
        config_cls.from_json_dict(data, source="cfg.json")


def test_unknown_size_is_rejected():
    with pytest.raises(ValueError, match="unknown DiT size 'huge'"):
        config_for_size("huge")

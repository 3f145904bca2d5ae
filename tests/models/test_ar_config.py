"""`moe_type` parsing and the named AR configurations (reference and serving copies alike)."""

from __future__ import annotations

import json
import math

import pytest

from reference_models.ar import config as ref_cfg
from serving_models.ar import config as srv_cfg

MOE_ENABLES = {"reference": ref_cfg.moe_enable, "serving": srv_cfg.moe_enable}


def moe_enable_violations(moe_enable) -> list[str]:
    """Every rule of docs/model.md §4 that `moe_enable` breaks (empty when it follows upstream)."""
    expected = [
        # half-open and 0-based: "ffn-18:36" is on at 18 and 35, off at 17 and 36
        (("ffn-18:36", "ffn", 17), False),
        (("ffn-18:36", "ffn", 18), True),
        (("ffn-18:36", "ffn", 35), True),
        (("ffn-18:36", "ffn", 36), False),
        (("ffn-14:28", "ffn", 13), False),
        (("ffn-14:28", "ffn", 14), True),
        (("ffn-14:28", "ffn", 27), True),
        (("ffn-14:28", "ffn", 28), False),
        # a bare type is unbounded
        (("ffn", "ffn", 0), True),
        (("ffn", "ffn", 10**6), True),
        # "none" enables nothing
        (("none", "ffn", 0), False),
        (("none", "attention", 5), False),
        # substring rule: "ffn" and "attention" are both inside "ffn_attention"
        (("ffn_attention-0:4", "ffn", 3), True),
        (("ffn_attention-0:4", "attention", 0), True),
        (("ffn_attention-0:4", "ffn", 4), False),
        (("attention-0:4", "ffn", 1), False),
        (("ffn-0:4", "attention", 1), False),
        # an empty range is legal and enables nothing
        (("ffn-3:3", "ffn", 3), False),
    ]
    return [f"moe_enable{args} -> {not want}, expected {want}" for args, want in expected if moe_enable(*args) != want]


@pytest.mark.parametrize("impl", sorted(MOE_ENABLES))
def test_moe_enable_follows_upstream(impl: str) -> None:
    assert moe_enable_violations(MOE_ENABLES[impl]) == []


@pytest.mark.parametrize(
    "mutant",
    [
        lambda t, lt, i: MOE_ENABLES["reference"](t, lt, i) or (t == "ffn-18:36" and i == 36) or (t == "ffn-14:28" and i == 28),
        lambda t, lt, i: MOE_ENABLES["reference"](t, lt, i - 1),  # shifted by one
        lambda t, lt, i: t.split("-")[0] == lt and MOE_ENABLES["reference"](t, lt, i),  # exact match, not substring
        lambda t, lt, i: t != "none",  # ignores the range
    ],
    ids=["inclusive_end", "shifted", "exact_type_match", "no_range"],
)
def test_moe_enable_check_catches_mutants(mutant) -> None:
    assert moe_enable_violations(mutant) != []


@pytest.mark.parametrize("impl", sorted(MOE_ENABLES))
@pytest.mark.parametrize(
    "bad",
    ["mlp", "", "ffn-14", "ffn-a:b", "ffn-14:28:30", "ffn-1-2:3", "ffn14:28", "ffn-5:3", "moe-0:4", "ffn--1:4"],
)
def test_invalid_moe_type_raises_a_clear_error(impl: str, bad: str) -> None:
    with pytest.raises(ValueError, match="moe_type") as info:
        MOE_ENABLES[impl](bad, "ffn", 0)
    assert repr(bad) in str(info.value)


def test_parse_moe_type_ranges() -> None:
    assert ref_cfg.parse_moe_type("ffn-14:28") == ref_cfg.MoERange("ffn", 14, 28)
    assert ref_cfg.parse_moe_type("ffn") == ref_cfg.MoERange("ffn", 0, math.inf)
    assert srv_cfg.moe_layer_range("ffn_attention-2:4") == ("ffn_attention", 2, 4)


def test_named_configs_match_the_spec() -> None:
    tiny, full = ref_cfg.ar_config("tiny"), ref_cfg.ar_config("full")
    assert (tiny.num_hidden_layers, tiny.hidden_size, tiny.num_attention_heads, tiny.num_key_value_heads) == (
        4,
        64,
        4,
        2,
    )
    assert (tiny.intermediate_size, tiny.rms_norm_eps, tiny.rope_theta, tiny.head_dim) == (128, 1e-6, 1e6, 16)
    assert (tiny.vocab_size, tiny.gen_vocab_size, tiny.gen_vocab_start_index) == (256, 64, 256)
    assert tiny.moe_type == "ffn-2:4" and tiny.moe_layers == (2, 3) and tiny.logits_width == 320
    assert (full.hidden_size, full.num_hidden_layers, full.num_attention_heads, full.num_key_value_heads) == (
        3584,
        28,
        28,
        4,
    )
    assert (full.intermediate_size, full.vocab_size, full.gen_vocab_size) == (18944, 152064, 32800)
    assert full.moe_layers == tuple(range(14, 28)) and full.rope_theta == 1e6 and full.rms_norm_eps == 1e-6
    layout = ref_cfg.token_layout("tiny")
    assert (layout.eol, layout.eof, layout.image_start, layout.image_end) == (256, 257, 262, 263)
    assert (layout.visual_start, layout.visual_end) == (264, 319)
    with pytest.raises(ValueError, match="unknown AR size 'huge'"):
        ref_cfg.ar_config("huge")


def test_config_json_round_trip_and_errors(tmp_path) -> None:
    tiny = ref_cfg.ar_config("tiny")
    tiny.save(tmp_path)
    assert ref_cfg.MammothModa2ARConfig.from_pretrained(tmp_path) == tiny
    served = srv_cfg.MammothModa2ARConfig.from_pretrained(tmp_path)
    assert served.to_dict() == tiny.to_dict()
    assert srv_cfg.MammothModa2ARConfig.from_any(tiny) == served

    data = json.loads((tmp_path / "config.json").read_text())
    data["moe_typo"] = "ffn"
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"unknown AR config keys \['moe_typo'\]"):
        ref_cfg.MammothModa2ARConfig.from_pretrained(tmp_path)
    # The gen start need not be the table size (Dev: 151936 rows, start 152064); a negative one is refused.
    assert tiny.replace(vocab_size=255).logits_width == 255 + 64
    with pytest.raises(ValueError, match="gen_vocab_start_index -1 must be non-negative"):
        tiny.replace(gen_vocab_start_index=-1)
    with pytest.raises(ValueError, match="moe_type 'ffn-4:2'"):
        tiny.replace(moe_type="ffn-4:2")

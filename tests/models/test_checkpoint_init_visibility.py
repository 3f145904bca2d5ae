"""Random checkpoints draw biases and norm weights, so a bias or norm weight a port drops, swaps or
misapplies is seen by the numeric rule the suites gate on (`parity.compare.golden_noise_rule`);
with upstream's zero biases and unit norm weights the same defects left every output unchanged.

Each defect is applied to the serving model after loading (the catalogue's mutants of the same
names apply it in the loader); the reference and the fp64 golden are built from the same state.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from parity.compare import FAIL, PASS, golden_noise_rule
from reference_models import checkpoints
from reference_models.ar.adapter import ReferenceARAdapter
from reference_models.ar.config import ar_config
from reference_models.dit.adapter import ReferenceDiT
from reference_models.dit.checkpoint import random_state_dict as dit_state_dict
from reference_models.dit.config import config_for_size
from serving_models.ar.adapter import ServingARAdapter
from serving_models.dit import adapter as serving_dit
from serving_models.dit import model as serving_dit_model

AR = ar_config("tiny")
IDS = torch.tensor([[3, 17, AR.gen_vocab_start_index + 4, 42, AR.gen_vocab_start_index + 20, 99, 5, 7]])


def upstream_init(state: dict[str, torch.Tensor], norm_names: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The same state with upstream's constants: zero biases, unit norm weights."""
    out = {}
    for name, value in state.items():
        if name.endswith(".bias"):
            out[name] = torch.zeros_like(value)
        elif norm_names(name):
            out[name] = torch.ones_like(value)
        else:
            out[name] = value
    return out


def swap_qkv_bias_shards(adapter: ServingARAdapter) -> None:
    """k and v bias rows exchanged inside every fused q|k|v bias (`qkv-bias-shards-swapped`)."""
    for module in adapter.module.modules():
        if hasattr(module, "output_sizes") and module.bias is not None and len(module.output_sizes) == 3:
            q, k, v = module.output_sizes
            with torch.no_grad():
                bias = module.bias.clone()
                module.bias[q : q + k] = bias[q + k :]
                module.bias[q + k :] = bias[q : q + k]


def swap_layernorm_weights(adapter: ServingARAdapter) -> None:
    """input_layernorm and post_attention_layernorm weights exchanged (`layernorm-weights-swapped`)."""
    for layer in adapter.module.language_model.model.layers:
        a, b = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        layer.input_layernorm.weight, layer.post_attention_layernorm.weight = b, a


def ar_verdict(state: dict[str, torch.Tensor], defect: Callable[[ServingARAdapter], None]) -> str:
    golden = ReferenceARAdapter.build(AR, {k: v.double() for k, v in state.items()}, "cpu", torch.float64).forward(IDS).logits
    reference = ReferenceARAdapter.build(AR, state, "cpu", torch.float32).forward(IDS).logits
    target = ServingARAdapter.build(AR, {k: v.clone() for k, v in state.items()}, "cpu", torch.float32)
    defect(target)
    verdict, _ = golden_noise_rule(golden, reference, target.forward(IDS).logits, name="logits")
    return verdict.verdict


@pytest.mark.parametrize("defect", [swap_qkv_bias_shards, swap_layernorm_weights], ids=lambda f: f.__name__)
def test_ar_bias_and_norm_defects_are_visible_only_with_drawn_values(defect) -> None:
    state = checkpoints.random_state_dict(AR, 0)
    assert ar_verdict(state, lambda adapter: None) == PASS  # the correct target passes
    assert ar_verdict(state, defect) == FAIL  # drawn biases and norm weights: the defect shows
    upstream = upstream_init(state, lambda name: name.endswith("norm.weight"))
    assert ar_verdict(upstream, defect) == PASS  # zero biases, unit norms: the same defect is invisible


DIT = config_for_size("tiny")


def swap_qk_norm_weights(adapter) -> None:
    for attention in adapter.module.modules():
        if isinstance(attention, serving_dit_model.Attention):
            q, k = attention.norm_q.weight, attention.norm_k.weight
            attention.norm_q.weight, attention.norm_k.weight = k, q


def drop_adaln_bias(adapter) -> None:
    for norm in adapter.module.modules():
        if isinstance(norm, serving_dit_model.LuminaRMSNormZero):
            norm.linear.bias = None


def dit_verdict(state: dict[str, torch.Tensor], defect) -> str:
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(1, DIT.in_channels, 32, 32, generator=generator)
    text = torch.randn(1, 4, DIT.text_feat_dim, generator=generator)
    mask = torch.ones(1, 4, dtype=torch.bool)
    t = torch.tensor([0.37])
    golden = ReferenceDiT.build(DIT, {k: v.double() for k, v in state.items()}, "cpu", torch.float64)
    truth = golden.forward(latents.double(), t.double(), text.double(), mask)
    reference = ReferenceDiT.build(DIT, state, "cpu", torch.float32).forward(latents, t, text, mask)
    target = serving_dit.build(DIT, {k: v.clone() for k, v in state.items()}, "cpu", torch.float32)
    defect(target)
    verdict, _ = golden_noise_rule(truth, reference, target.forward(latents, t, text, mask), name="velocity")
    return verdict.verdict


@pytest.mark.parametrize("defect", [swap_qk_norm_weights, drop_adaln_bias], ids=lambda f: f.__name__)
def test_dit_bias_and_norm_defects_are_visible_only_with_drawn_values(defect) -> None:
    state = dit_state_dict(DIT, 0)
    assert dit_verdict(state, lambda adapter: None) == PASS
    assert dit_verdict(state, defect) == FAIL
    upstream = upstream_init(state, lambda name: state[name].ndim == 1)
    assert dit_verdict(upstream, defect) == PASS

"""Stage defects planted in the third-party-shaped example targets, as `--parity-target` factories.

Each factory returns one of the examples (`examples/engine_target`, vLLM-shaped, forward hooks of
its own; `examples/llama_style_target`, Llama-shaped, no hooks, its own fused-module names, a joint
q|k rotary module) with one defect a porter makes, planted from outside the engine's code (the
engine files stay as committed). `DEFECTS` says which stage each one sits in: the stage the chain
must name in every mode (tests/harness/test_localise_third_party.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from examples.engine_target.engine import RMSNorm as EngineRMSNorm
from examples.llama_style_target.model import RMSNorm as LlamaRMSNorm
from examples.llama_style_target.model import TwoExperts


class Defect(NamedTuple):
    factory: str  # `tests.support.stage_defects:<name>`
    stage: str  # the stage the defect sits in
    what: str


def _eps_outside_sqrt(norm: nn.Module, x: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / (sqrt(mean(x^2)) + eps)`: the epsilon added outside the square root."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h / (h.pow(2).mean(-1, keepdim=True).sqrt() + eps)
    return norm.weight * h.to(x.dtype)


class EngineEpsOutsideSqrt(EngineRMSNorm):
    """The vLLM-shaped engine's fused-residual norm with the defect."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return _eps_outside_sqrt(self, x, self.eps)
        x = x + residual
        return _eps_outside_sqrt(self, x, self.eps), x


class LlamaEpsOutsideSqrt(LlamaRMSNorm):
    """The Llama-shaped engine's norm with the defect."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _eps_outside_sqrt(self, x, self.eps)


class HostReadExperts(TwoExperts):
    """The experts with a shortcut a porter adds: skip the image expert when no token needs it,
    asked on the host (`bool(mask.any())`), which a captured or compiled graph cannot do."""

    def forward(self, h: torch.Tensor, gen_mask: torch.Tensor | None, capturing: bool = False) -> torch.Tensor:
        if gen_mask is None or self.image is None or not bool(gen_mask.any()):  # the host read
            return self.text(h)
        return torch.where(gen_mask[..., None], self.image(h), self.text(h))


def _on_load(target: Any, change: Any) -> Any:
    """`target` whose AR adapters get `change(adapter)` applied after every load and build."""
    load_ar, build_ar = target.load_ar, target.build_ar

    def load(*args: Any, **kwargs: Any) -> Any:
        adapter = load_ar(*args, **kwargs)
        change(adapter)
        return adapter

    def build(*args: Any, **kwargs: Any) -> Any:
        adapter = build_ar(*args, **kwargs)
        change(adapter)
        return adapter

    target.load_ar, target.build_ar = load, build
    return target


# ---- examples/engine_target (vLLM-shaped) ----


def engine_eps_outside_sqrt() -> Any:
    """Layer 0's input norm adds epsilon outside the square root."""
    from examples.engine_target import parity_target

    broken = EngineEpsOutsideSqrt

    def change(adapter: Any) -> None:
        adapter.module.layers[0].input_layernorm.__class__ = broken

    return _on_load(parity_target.make_target(), change)


def engine_gen_down_from_und() -> Any:
    """Layer 2's gen expert down projection holds the und expert's weights (a loader mix-up)."""
    from examples.engine_target import parity_target

    def change(adapter: Any) -> None:
        layer = adapter.module.layers[2]
        layer.gen_mlp.down_proj.weight.data.copy_(layer.mlp.down_proj.weight.data)

    return _on_load(parity_target.make_target(), change)


def engine_gen_down_from_und_honest_map() -> Any:
    """The same loader mix-up, with a name map that says so: layer 2's gen `down_proj` lists the und
    expert's checkpoint tensor, and no parameter lists the gen expert's (weight_coverage's case)."""
    from examples.engine_target import parity_target

    def change(adapter: Any) -> None:
        layer = adapter.module.layers[2]
        layer.gen_mlp.down_proj.weight.data.copy_(layer.mlp.down_proj.weight.data)
        names = adapter._checkpoint_names
        names["layers.2.gen_mlp.down_proj.weight"] = list(names["layers.2.mlp.down_proj.weight"])

    return _on_load(parity_target.make_target(), change)


# ---- examples/llama_style_target (Llama-shaped, no hooks) ----


def llama_eps_outside_sqrt() -> Any:
    """Layer 0's attention norm adds epsilon outside the square root."""
    from examples.llama_style_target import parity_target

    broken = LlamaEpsOutsideSqrt

    def change(adapter: Any) -> None:
        adapter.module.layers[0].attention_norm.__class__ = broken

    return _on_load(parity_target.make_target(), change)


def llama_gen_down_from_und() -> Any:
    """Layer 2's image expert `w2` holds the text expert's weights (a loader mix-up)."""
    from examples.llama_style_target import parity_target

    def change(adapter: Any) -> None:
        ffn = adapter.module.layers[2].ffn
        ffn.image.w2.weight.data.copy_(ffn.text.w2.weight.data)

    return _on_load(parity_target.make_target(), change)


def llama_rotary_theta() -> Any:
    """Layer 1's joint rotary module built with RoPE theta 10000, not the config's."""
    from examples.llama_style_target import parity_target

    def change(adapter: Any) -> None:
        adapter.module.layers[1].attention.rotary.theta = 10000.0

    return _on_load(parity_target.make_target(), change)


def llama_host_read() -> Any:
    """Every MoE layer's experts read the gen mask on the host (an error in the graph modes)."""
    from examples.llama_style_target import parity_target

    def change(adapter: Any) -> None:
        for block in adapter.module.layers:
            block.ffn.__class__ = HostReadExperts

    return _on_load(parity_target.make_target(), change)


DEFECTS = {
    "engine-eps-outside-sqrt": Defect(
        "tests.support.stage_defects:engine_eps_outside_sqrt", "layer.0.input_norm", "epsilon outside the square root"
    ),
    "engine-gen-down-from-und": Defect(
        "tests.support.stage_defects:engine_gen_down_from_und",
        "layer.2.gen_mlp.down",
        "gen down projection loaded from the und expert",
    ),
    "llama-eps-outside-sqrt": Defect(
        "tests.support.stage_defects:llama_eps_outside_sqrt", "layer.0.input_norm", "epsilon outside the square root"
    ),
    "llama-gen-down-from-und": Defect(
        "tests.support.stage_defects:llama_gen_down_from_und",
        "layer.2.gen_mlp.down",
        "image expert w2 loaded from the text expert",
    ),
    "llama-rotary-theta": Defect(
        "tests.support.stage_defects:llama_rotary_theta", "layer.1.q_rope", "joint rotary module with theta 10000"
    ),
}

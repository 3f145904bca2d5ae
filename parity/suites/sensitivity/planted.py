"""The planted catalogue: target-level defects any target can be given, one per slip a port ships.

Every entry is planted through a surface of the contract (`plant.py`: the checkpoint, the config,
the capture-probe registry, the calls), names the suite that must kill it and says when it is
equivalent on a target. `parity run --target SPEC --mutants` runs them all against SPEC and
prints `mutation score on <target name>: K/N`; docs/mutants.md, "Your target's score", is generated
from these entries. Each is a `--target` factory: `PARITY_PLANTED_ON=SPEC` and `--parity-target
parity.suites.sensitivity.planted:mutant_<name with _ for ->`.

The tensor changes use the reference's names (upstream's, docs/checkpoints.md) and replace
tensors, never write into one. Every AR change is made in layer 0 (or the first MoE layer, or every
layer for a layout), where the numerics suite compares the first hidden state.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.suites.sensitivity.catalogue import Kill, NotApplicable
from parity.suites.sensitivity.plant import Equivalent, Planted, Proxy, Tensors, factory_lookup, markdown, register

__getattr__ = factory_lookup(__name__)
__all__ = ["markdown"]  # docs/mutants.md's "Your target's score" (catalogue.SECTION_MODULES)

NUMERICS_EAGER = ("parity/suites/ar/test_numerics.py", "-k", "layer_by_layer and eager")
EXPERT_SELECTION_EAGER = ("parity/suites/ar/test_expert_selection.py", "-k", "test_expert_selection and eager")
CAPTURE_WITHOUT_MASK = ("parity/suites/ar/test_fail_closed_capture.py", "-k", "capture_without_mask")
DECODE_TEACHER_FORCED = ("parity/suites/ar/test_decode.py", "-k", "teacher_forced and eager")
DIT_NUMERICS_EAGER = ("parity/suites/dit/test_numerics.py", "-k", "reference")
ROUTING_PADS = ("parity/suites/routing/test_edges.py", "-k", "pad-")
ROUTING_BIASED_GRID = ("parity/suites/routing/test_grid.py", "-k", "grid-grouped and fp32 and T64")

LAYER0 = "model.layers.0."


def _lanes(tests: tuple[str, ...], cuda: Kill | NotApplicable | None = None) -> dict[str, Kill | NotApplicable]:
    return {"cpu": Kill(tests), "cuda": cuda if cuda is not None else Kill(tests)}


def _fp32_on_cuda(tests: tuple[str, ...], why: str) -> dict[str, Kill | NotApplicable]:
    return _lanes(tests, Kill(tests, dtype="fp32", why=why))


def _need(state: Tensors, *names: str) -> None:
    missing = [name for name in names if name not in state]
    if missing:
        raise Equivalent(f"the checkpoint has no {', '.join(missing)}")


def _swap(state: Tensors, a: str, b: str) -> None:
    _need(state, a, b)
    if state[a].shape != state[b].shape:
        raise Equivalent(f"{a} {tuple(state[a].shape)} and {b} {tuple(state[b].shape)} differ in shape")
    state[a], state[b] = state[b], state[a]


def _swap_blocks(state: Tensors, name: str, width: int, first: int, second: int) -> None:
    """Rows `[first*width, (first+1)*width)` and `[second*width, ...)` of `name` exchanged (a new tensor)."""
    _need(state, name)
    order = torch.arange(state[name].shape[0])
    a, b = order[first * width : (first + 1) * width].clone(), order[second * width : (second + 1) * width].clone()
    order[first * width : (first + 1) * width], order[second * width : (second + 1) * width] = b, a
    state[name] = state[name].index_select(0, order.to(state[name].device))


# ---------------------------------------------------------------------------------------------
# AR backbone: the checkpoint
# ---------------------------------------------------------------------------------------------


def _first_moe_layer(state: Tensors) -> int:
    layers = sorted({int(name.split(".")[2]) for name in state if name.startswith("model.layers.") and ".gen_mlp." in name})
    if not layers:
        raise Equivalent("no layer has a gen expert (gen_mlp)")
    return layers[0]


def _experts_swapped(state: Tensors, config: Any) -> None:
    layer = _first_moe_layer(state)
    for part in ("gate_proj", "up_proj", "down_proj"):
        _swap(state, f"model.layers.{layer}.mlp.{part}.weight", f"model.layers.{layer}.gen_mlp.{part}.weight")


register(
    Planted(
        "und-gen-experts-swapped",
        defect="the first MoE layer's und expert (mlp) and gen expert (gen_mlp) exchanged by the loader's name map: every "
        "token takes the expert its id asks for, with the other expert's weights",
        surface="checkpoint",
        family="ar",
        suite="expert_selection",
        lanes=_lanes(EXPERT_SELECTION_EAGER),
        equivalent_when="the checkpoint has no MoE layer (no gen_mlp tensors)",
        tensors=_experts_swapped,
    )
)


def _swap_heads(state: Tensors, projection: str, head_dim: int) -> None:
    """Heads 0 and 1 of a projection exchanged: its weight's rows, and its bias's where it has one."""
    _swap_blocks(state, f"{projection}.weight", head_dim, 0, 1)
    if f"{projection}.bias" in state:
        _swap_blocks(state, f"{projection}.bias", head_dim, 0, 1)


def _q_heads_permuted(state: Tensors, config: Any) -> None:
    if config.num_attention_heads < 2:
        raise Equivalent(f"{config.num_attention_heads} attention head: nothing to permute")
    _swap_heads(state, f"{LAYER0}self_attn.q_proj", config.head_dim)


register(
    Planted(
        "q-heads-permuted",
        defect="layer 0's query heads 0 and 1 exchanged (a head split or fused-q|k|v reshape that orders heads differently "
        "from the checkpoint): every tensor loads with its shape",
        surface="checkpoint",
        family="ar",
        suite="numerics",
        lanes=_lanes(NUMERICS_EAGER),
        equivalent_when="the model has one attention head",
        tensors=_q_heads_permuted,
    )
)


def _kv_heads_permuted(state: Tensors, config: Any) -> None:
    if config.num_key_value_heads < 2:
        raise Equivalent(f"{config.num_key_value_heads} key/value head: nothing to permute")
    for part in ("k_proj", "v_proj"):
        _swap_heads(state, f"{LAYER0}self_attn.{part}", config.head_dim)


register(
    Planted(
        "kv-heads-permuted",
        defect="layer 0's key/value heads 0 and 1 exchanged (a GQA group mapping that pairs query heads with the wrong "
        "key/value head)",
        surface="checkpoint",
        family="ar",
        suite="numerics",
        lanes=_lanes(NUMERICS_EAGER),
        equivalent_when="the model has one key/value head",
        tensors=_kv_heads_permuted,
    )
)


# One norm weight off by a relative 2^-14 (6.1e-5): measured on the tiny fp32 models (the minimal
# target, seed 0), layer 0's RMSE against the fp64 golden is then about 85 times the numerics bound
# (9.4e-7 against 1.1e-8), where 2^-10 was 1,400 times: near the noise floor, never inside it. In
# bf16 it is 1/128 of the spacing of a weight near 1: rounded away, so the CUDA lane checks it in fp32.
NORM_SCALE = 1.0 + 2.0**-14


def _norm_scaled(state: Tensors, config: Any) -> None:
    name = f"{LAYER0}input_layernorm.weight"
    _need(state, name)
    state[name] = state[name] * NORM_SCALE


register(
    Planted(
        "norm-weight-scaled",
        defect="layer 0's input norm weight scaled by 1 + 2^-14 (a weight rounded through another precision, or an "
        "offset convention off by a little): a defect just above the fp32 noise floor",
        surface="checkpoint",
        family="ar",
        suite="numerics",
        lanes=_fp32_on_cuda(
            NUMERICS_EAGER,
            "a relative 2^-14 is 1/128 of the bf16 spacing of a norm weight near 1: rounded away when the target "
            "loads in bf16, an equivalent mutant there, so the CUDA lane checks it in fp32",
        ),
        equivalent_when="the checkpoint has no input norm weight in layer 0",
        tensors=_norm_scaled,
    )
)


def _bias_zeroed(state: Tensors, config: Any) -> None:
    name = f"{LAYER0}self_attn.q_proj.bias"
    if name not in state:
        raise Equivalent("the checkpoint has no attention biases (q_proj.bias)")
    if state[name].device.type != "meta" and not bool(state[name].any()):
        raise Equivalent(f"{name} is zero already")
    state[name] = torch.zeros_like(state[name])


register(
    Planted(
        "bias-zeroed",
        defect="layer 0's q_proj bias zeroed (a fused q|k|v built without bias, or its bias never loaded): invisible "
        "with zero biases",
        surface="checkpoint",
        family="ar",
        suite="numerics",
        lanes=_lanes(NUMERICS_EAGER),
        equivalent_when="the checkpoint has no attention bias, or it is zero",
        tensors=_bias_zeroed,
    )
)


def _rope_layout_interleaved(state: Tensors, config: Any) -> None:
    """q and k rows of every head reordered from rotate-half (pairs i, i + d/2) to interleaved
    (pairs 2i, 2i + 1): the permutation a checkpoint converter applies for the other RoPE layout."""
    dim = config.head_dim
    if dim < 4:
        raise Equivalent(f"head_dim {dim}: both RoPE layouts pair the same rows")
    within = torch.arange(dim).view(2, dim // 2).t().reshape(-1)  # [0, d/2, 1, d/2 + 1, ...]
    for layer in range(config.num_hidden_layers):
        for part, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads)):
            order = (torch.arange(heads)[:, None] * dim + within[None, :]).reshape(-1)
            for kind in ("weight", "bias"):
                name = f"model.layers.{layer}.self_attn.{part}.{kind}"
                if name in state:
                    state[name] = state[name].index_select(0, order.to(state[name].device))
                elif kind == "weight":
                    _need(state, name)


register(
    Planted(
        "rope-layout-interleaved",
        defect="q and k rows of every head permuted from the rotate-half RoPE layout to the interleaved one (a "
        "converter's permute applied to a checkpoint already in the model's layout): q.k is unchanged at position 0, "
        "and every rotation pairs the wrong rows after it",
        surface="checkpoint",
        family="ar",
        suite="numerics",
        lanes=_lanes(NUMERICS_EAGER),
        equivalent_when="head_dim < 4 (both layouts pair the same rows)",
        tensors=_rope_layout_interleaved,
    )
)


def _heads_exchanged(state: Tensors, config: Any) -> None:
    _need(state, "lm_head.weight", "gen_head.weight")
    text, gen = state["lm_head.weight"], state["gen_head.weight"]
    rows = min(text.shape[0], gen.shape[0])
    if text.shape[1:] != gen.shape[1:]:
        raise Equivalent(f"lm_head {tuple(text.shape)} and gen_head {tuple(gen.shape)} differ in width")
    state["lm_head.weight"] = torch.cat([gen[:rows], text[rows:]])
    state["gen_head.weight"] = torch.cat([text[:rows], gen[rows:]])


register(
    Planted(
        "gen-and-text-heads-exchanged",
        defect="the gen head and the text head exchanged by the loader (their first gen_vocab_size rows, so every shape "
        "holds): gen logits from text-head rows and back",
        surface="checkpoint",
        family="ar",
        suite="numerics",
        lanes=_lanes(NUMERICS_EAGER),
        equivalent_when="the checkpoint has no separate gen head",
        tensors=_heads_exchanged,
    )
)


def _gate_up_swapped(state: Tensors, config: Any) -> None:
    _swap(state, f"{LAYER0}mlp.gate_proj.weight", f"{LAYER0}mlp.up_proj.weight")


register(
    Planted(
        "gate-up-swapped",
        defect="layer 0's gate and up projections exchanged (a fused gate|up stacked in the other order): silu(up) * "
        "gate instead of silu(gate) * up",
        surface="checkpoint",
        family="ar",
        suite="numerics",
        lanes=_lanes(NUMERICS_EAGER),
        equivalent_when="the MLP has no separate gate and up projections of one shape",
        tensors=_gate_up_swapped,
    )
)


# ---------------------------------------------------------------------------------------------
# AR backbone: the config
# ---------------------------------------------------------------------------------------------

BF16_BLIND = (
    "the change moves the first layer by far less than bf16 rounding at the numerics prompts' positions (the built-in "
    "catalogue's rope-theta-default and rmsnorm-eps-1e-5 measured it): equivalent at bf16, so the CUDA lane checks it in fp32"
)


def _rope_theta(config: Any) -> dict[str, Any]:
    return {"rope_theta": 10000.0 if config.rope_theta != 10000.0 else 1_000_000.0}


register(
    Planted(
        "rope-theta-changed",
        defect="the target given rope_theta 10000 (1e6 when it is 10000): a port that reads theta from another field, "
        "or keeps its class default",
        surface="config",
        family="ar",
        suite="numerics",
        lanes=_fp32_on_cuda(NUMERICS_EAGER, BF16_BLIND),
        equivalent_when="the target does not take rope_theta from its config (its adapter's config keeps the old value)",
        config=_rope_theta,
    )
)


def _norm_eps(config: Any) -> dict[str, Any]:
    return {"rms_norm_eps": config.rms_norm_eps * 10}


register(
    Planted(
        "norm-eps-changed",
        defect="the target given rms_norm_eps ten times the checkpoint's (1e-5 for 1e-6: a class default where the "
        "release sets its own)",
        surface="config",
        family="ar",
        suite="numerics",
        lanes=_fp32_on_cuda(NUMERICS_EAGER, BF16_BLIND),
        equivalent_when="the target does not take rms_norm_eps from its config",
        config=_norm_eps,
    )
)


def _gen_start(config: Any) -> dict[str, Any]:
    return {"gen_vocab_start_index": config.gen_vocab_start_index + 1}


register(
    Planted(
        "gen-start-shifted",
        defect="the target given a gen vocabulary that starts one id later: every gen id looks up the previous gen row "
        "and the first one is routed as text (a start read as the text table's size, docs/checkpoints.md §4)",
        surface="config",
        family="ar",
        suite="numerics",
        lanes=_lanes(NUMERICS_EAGER),
        equivalent_when="the target does not take gen_vocab_start_index from its config",
        config=_gen_start,
    )
)


# ---------------------------------------------------------------------------------------------
# AR backbone: capture and calls
# ---------------------------------------------------------------------------------------------

register(
    Planted(
        "capture-probe-dropped",
        defect="the target hands parity a capture-probe registry its model never asks (a registry per process or per "
        "engine instance): the model is never told it is being captured, so capture without a mask cannot fail closed",
        surface="capture",
        family="ar",
        suite="fail_closed_capture",
        lanes=_lanes(
            CAPTURE_WITHOUT_MASK,
            NotApplicable(
                "a CUDA stream capture is visible to the model without the harness's probe "
                "(torch.cuda.is_current_stream_capturing): only the CPU stand-in is announced through the registry alone"
            ),
        ),
        equivalent_when="the target does not support capture (supports_capture False), or its model learns of a capture "
        "without the registry",
        capture=True,
    )
)


class _ShiftedPositions(Proxy):
    """`decode_step` given every position one later than the harness asked (free-running decode
    goes through the same step)."""

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._inner.decode_step(input_ids, positions + 1)

    def greedy_generate(self, input_ids: torch.Tensor, max_new_tokens: int, step_fn: Any = None) -> Any:
        if step_fn is None:
            self._inner.allocate_decode_state(input_ids.shape[0], input_ids.shape[1] + max_new_tokens)
        return self._inner.greedy_generate(input_ids, max_new_tokens, step_fn=step_fn or self.decode_step)


register(
    Planted(
        "decode-positions-shifted",
        defect="decode_step given position L+i+1 for step i (a sequence length used as the position): one KV slot "
        "skipped and every RoPE angle one ahead",
        surface="calls",
        family="ar",
        suite="decode",
        lanes=_lanes(DECODE_TEACHER_FORCED),
        equivalent_when="never for a model with RoPE or a KV cache indexed by position",
        adapter=_ShiftedPositions,
    )
)


# ---------------------------------------------------------------------------------------------
# DiT
# ---------------------------------------------------------------------------------------------

DIT_MODULATION = "layers.0.norm1.linear"


def _adaln_chunks_swapped(state: Tensors, config: Any) -> None:
    """The modulation linear's output chunks (Lumina2: scale_msa, gate_msa, scale_mlp, gate_mlp)
    read in another order: the first two exchanged."""
    _need(state, f"{DIT_MODULATION}.weight")
    width = state[f"{DIT_MODULATION}.weight"].shape[0] // 4
    for kind in ("weight", "bias"):
        if f"{DIT_MODULATION}.{kind}" in state:
            _swap_blocks(state, f"{DIT_MODULATION}.{kind}", width, 0, 1)


register(
    Planted(
        "dit-adaln-chunks-swapped",
        defect="the first block's adaLN modulation chunks read in another order (scale and gate of the attention branch "
        "exchanged: the scale/shift order slip of a port from another DiT)",
        surface="checkpoint",
        family="dit",
        suite="numerics",
        lanes=_lanes(DIT_NUMERICS_EAGER),
        equivalent_when="the DiT's blocks have no adaLN modulation linear",
        tensors=_adaln_chunks_swapped,
    )
)


def _refiner_from_block(state: Tensors, config: Any) -> None:
    copied = 0
    for name in [n for n in state if n.startswith("noise_refiner.0.")]:
        source = "layers.0." + name.removeprefix("noise_refiner.0.")
        if source in state and state[source].shape == state[name].shape:
            state[name] = state[source].clone()  # a tensor of its own: a checkpoint stores no shared memory
            copied += 1
    if not copied:
        raise Equivalent("no noise refiner block shares tensors of one shape with the first transformer block")


register(
    Planted(
        "dit-refiner-from-another-block",
        defect="the noise refiner's weights loaded from the first transformer block (a prefix map that matches "
        "`layers.0.` inside `noise_refiner.0.`): every shape holds",
        surface="checkpoint",
        family="dit",
        suite="numerics",
        lanes=_lanes(DIT_NUMERICS_EAGER),
        equivalent_when="the DiT has no refiner block shaped like a transformer block",
        tensors=_refiner_from_block,
    )
)


# ---------------------------------------------------------------------------------------------
# MoE routing: the router's calls
# ---------------------------------------------------------------------------------------------


class _RouterWithout(Proxy):
    """The router called without one of its keyword arguments."""

    dropped = ""

    def select_experts(self, logits: torch.Tensor, k: int, **options: Any) -> Any:
        return self._inner.select_experts(logits, k, **{**options, self.dropped: None})


class _ValidRowsIgnored(_RouterWithout):
    dropped = "num_valid_rows"


class _CorrectionBiasDropped(_RouterWithout):
    dropped = "correction_bias"


register(
    Planted(
        "router-valid-rows-ignored",
        defect="the router called without its device-side num_valid_rows: pad rows routed to real experts "
        "(vllm-project/vllm#50757)",
        surface="calls",
        family="routing",
        suite="routing",
        lanes=_lanes(ROUTING_PADS),
        equivalent_when="never: the routing suite always pads",
        router=_ValidRowsIgnored,
    )
)
register(
    Planted(
        "router-correction-bias-dropped",
        defect="the router called without its correction bias (a DeepSeek-V3 e_score_correction_bias the engine's MoE "
        "layer never passes): biased grouped routing picks other experts",
        surface="calls",
        family="routing",
        suite="routing",
        lanes=_lanes(ROUTING_BIASED_GRID),
        equivalent_when="never: the routing suite's grouped kind always carries a bias",
        router=_CorrectionBiasDropped,
    )
)

"""The DiT's stages (the Lumina2 / OmniGen2-style `Transformer2DModel` and its sampling loop, docs/localise.md §2).

A forward runs the embedders, the RoPE table of the joint sequence, three block lists in turn
(the unmodulated context refiner on the text, the modulated noise refiner on the image, the
main stack on `[text, image]`) and the final layer. Every block has the same stages; the context
refiner's have no adaLN modulation, so its maps declare no `adaln`. An image case adds the
sampler around the model: the schedule, the guidance scale of each step, the latents after each
Euler step and the decoder's float RGB (the model's own stages are compared on a velocity case,
where both sides run one forward over the same batch).
"""

from __future__ import annotations

from typing import Any

from parity.localise.stages import Blocks, Stage, Vocabulary

_BLOCK = (
    Stage(
        "adaln", "adaLN modulation: scale and gate vectors from silu(temb) (modulated blocks)", ("time_embed",), per_layer=True
    ),
    Stage("attn_in", "pre-attention RMSNorm (times 1 + scale_msa where modulated)", ("prev:out", "adaln"), per_layer=True),
    Stage("q", "q projection", ("attn_in",), per_layer=True),
    Stage("k", "k projection", ("attn_in",), per_layer=True),
    Stage("v", "v projection", ("attn_in",), per_layer=True),
    Stage("q_norm", "per-head RMSNorm of q", ("q",), per_layer=True),
    Stage("k_norm", "per-head RMSNorm of k", ("k",), per_layer=True),
    Stage("q_rope", "q after RoPE (interleaved pairs)", ("q_norm", "rope"), per_layer=True),
    Stage("k_rope", "k after RoPE (interleaved pairs)", ("k_norm", "rope"), per_layer=True),
    Stage("attn", "attention output (key-padding masked), before the out projection", ("q_rope", "k_rope", "v"), per_layer=True),
    Stage("out_proj", "attention out projection", ("attn",), per_layer=True),
    Stage("attn_norm", "post-attention RMSNorm (the sandwich norm before the gated residual)", ("out_proj",), per_layer=True),
    Stage(
        "mlp_in",
        "pre-MLP RMSNorm of the residual sum (times 1 + scale_mlp where modulated)",
        ("attn_norm", "prev:out", "adaln"),
        per_layer=True,
    ),
    Stage("mlp", "SwiGLU feed-forward output", ("mlp_in",), per_layer=True),
    Stage("mlp_norm", "post-MLP RMSNorm", ("mlp",), per_layer=True),
    Stage(
        "out",
        "block output (residual + tanh(gate) * each branch where modulated)",
        ("mlp_norm", "attn_norm", "prev:out", "adaln"),
        per_layer=True,
    ),
)

VOCABULARY = Vocabulary(
    "dit",
    (
        Stage("timesteps", "the sampler's flow-match schedule (the N + 1 times)"),
        Stage("guidance", "the text guidance scale in force at each step (the CFG range latch)"),
        Stage("time_embed", "timestep embedding temb (sinusoidal features, then the MLP)"),
        Stage("caption_embed", "caption embedding of the LLM states (RMSNorm, Linear)"),
        Stage("x_embed", "patch embedding of the latents (x_embedder)"),
        Stage("rope", "RoPE cos of every token of the joint sequence (t, h, w axes)"),
        *_BLOCK,
        Stage("norm_out", "final layer: LayerNorm times 1 + scale(temb), then the linear to patches", ("last:out", "time_embed")),
        Stage(
            "velocity",
            "the model's output velocity (an image case: the calls of the first step, conditional then unconditional)",
            ("norm_out", "timesteps", "guidance"),
        ),
        Stage("latents", "the latents after every Euler step of the sampling loop", ("velocity", "timesteps", "guidance")),
        Stage("decoded", "the decoder's float RGB, before the conversion to uint8", ("latents",)),
    ),
    entry="x_embed",
    blocks=(
        Blocks("context_refiner", entry=("caption_embed",)),
        Blocks("noise_refiner", entry=("x_embed",)),
        Blocks("layers", entry=("context_refiner:out", "noise_refiner:out")),
    ),
)

# The stages of an image case's chain: the sampler around the model (the model's inner stages run
# once per step and branch there, and the two sides batch CFG differently: they are compared on
# velocity cases instead).
IMAGE_STAGES = ("timesteps", "guidance", "velocity", "latents", "decoded")

# How an adapter lays out the joint sequence of the main stack (its `joint_layout`), so that a
# velocity case compares the same tokens on both sides: "packed", upstream's `[text[:cap_len],
# image]` padded at the tail with the head over every token; "text_slots", `[text slots (padding
# included), image]` with the head over the image tokens only.
JOINT_LAYOUTS = ("packed", "text_slots")


def block_counts(config: Any) -> dict[str, int]:
    """The blocks of each block list for a DiT config (`num_refiner_layers`, `num_layers`)."""
    refiners = int(config.num_refiner_layers)
    return {"context_refiner": refiners, "noise_refiner": refiners, "layers": int(config.num_layers)}

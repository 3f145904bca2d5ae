"""The AR backbone's stages (a Qwen2 decoder block with the und/gen expert pair, docs/localise.md §2)."""

from __future__ import annotations

from parity.localise.stages import Stage, Vocabulary


def _expert(prefix: str, rows: str, who: str) -> tuple[Stage, ...]:
    return (
        Stage(f"{prefix}.gate", f"{who} gate projection", ("post_norm",), per_layer=True, rows=rows),
        Stage(f"{prefix}.up", f"{who} up projection", ("post_norm",), per_layer=True, rows=rows),
        Stage(f"{prefix}.act", f"{who} silu(gate) * up", (f"{prefix}.gate", f"{prefix}.up"), per_layer=True, rows=rows),
        Stage(f"{prefix}.down", f"{who} down projection", (f"{prefix}.act",), per_layer=True, rows=rows),
    )


VOCABULARY = Vocabulary(
    "ar",
    (
        Stage("embed", "input embeddings (base and gen tables, blended by the gen mask)"),
        Stage("input_norm", "input RMSNorm", ("prev:out",), per_layer=True),
        Stage("q", "q projection (with its bias)", ("input_norm",), per_layer=True),
        Stage("k", "k projection (with its bias)", ("input_norm",), per_layer=True),
        Stage("v", "v projection (with its bias)", ("input_norm",), per_layer=True),
        Stage("q_rope", "q after RoPE", ("q",), per_layer=True),
        Stage("k_rope", "k after RoPE", ("k",), per_layer=True),
        Stage("attn", "attention output, before o_proj", ("q_rope", "k_rope", "v"), per_layer=True),
        Stage("o_proj", "attention output projection", ("attn",), per_layer=True),
        Stage("post_norm", "post-attention RMSNorm (on the residual sum)", ("o_proj", "prev:out"), per_layer=True),
        *_expert("mlp", "und", "und expert"),
        *_expert("gen_mlp", "gen", "gen expert"),
        Stage(
            "moe",
            "the und/gen expert blend (each token's expert output)",
            ("mlp.down", "gen_mlp.down", "post_norm"),
            per_layer=True,
        ),
        Stage("out", "decoder layer output (residual + expert)", ("moe", "post_norm"), per_layer=True),
        Stage("final_norm", "final RMSNorm", ("last:out",)),
        Stage("lm_head", "base vocabulary head", ("final_norm",)),
        Stage("gen_head", "gen vocabulary head", ("final_norm",)),
    ),
    entry="embed",
)

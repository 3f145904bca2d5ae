"""The MoE router's stages (docs/routing.md §2-§4): scores, selection keys, group mask, top-k ids,
weights, and the output after the pad rows past the device-side valid-row count are masked.

The selection stages cover the real rows only ("real": the rows before the count), the only rows
the reference routes; the masked output covers every row, so a pad row routed to a real expert
shows there. The golden is the reference with `golden=True`: fp64 scores and weights for the
experts it selects with its fp32 keys, so its keys, group mask and ids are the reference's own
(the keys are fp32 by rule R1: their bound is zero) and the float stages after them get the
reference's own distance from fp64 as their noise.
"""

from __future__ import annotations

from parity.localise.stages import Stage, Vocabulary

REAL = "real"  # the row set of the rows before the valid-row count (`Side.row_sets`)

VOCABULARY = Vocabulary(
    "routing",
    (
        Stage("scores", "the scoring function: softmax p = exp(x - row max) (0 off the candidates) or sigmoid σ(x)", rows=REAL),
        Stage(
            "keys",
            "selection keys: the fp32 logit (softmax) or σ(x) + correction bias, -inf off the candidates",
            ("scores",),
            rows=REAL,
        ),
        Stage("group_mask", "grouped top-k: the experts inside each row's topk_group best groups", ("keys",), rows=REAL),
        Stage(
            "topk_ids",
            "the top-k ids in slot order (equal keys: the lower id first), -1 past the candidates",
            ("keys", "group_mask"),
            rows=REAL,
        ),
        Stage(
            "weights", "the top-k weights after renormalisation, before routed_scaling_factor", ("scores", "topk_ids"), rows=REAL
        ),
        Stage("masked_ids", "the output ids, shared columns added, pad rows past the valid-row count -1", ("topk_ids",)),
        Stage(
            "masked_weights",
            "the output weights, scaled, shared columns added, pad rows past the valid-row count 0",
            ("weights",),
        ),
    ),
    entry="logits",
)

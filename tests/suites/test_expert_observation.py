"""expert_selection judges which expert a token used by the reference's weights too.

The observation recomputes the target's own `und` / `gen` modules on the tapped input
(`parity/suites/ar/support.py`). A loader that filled the first MoE layer's und expert from
gen_mlp's tensors and its gen expert from mlp's routes every token to the module its id asks
for, so its own modules call every token right: the switched-off variant (no reference) below
sees nothing, the judgment by the reference's experts sees every token of that layer.
"""

from __future__ import annotations

import pytest
import torch

from parity.runners import make_runner
from parity.suites.ar.support import TOL, moe_taps, observe_expert_use, routing_mismatches
from reference_models.ar.adapter import ReferenceARAdapter
from reference_models.checkpoints import random_state_dict
from serving_models.ar.adapter import ServingARAdapter
from tests.support.ar_support import START, TINY, mixed_ids

pytestmark = pytest.mark.parity_cpu


def _experts_swapped(state: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    swapped = dict(state)
    for part in ("gate_proj", "up_proj", "down_proj"):
        und, gen = f"model.layers.{layer}.mlp.{part}.weight", f"model.layers.{layer}.gen_mlp.{part}.weight"
        swapped[und], swapped[gen] = state[gen], state[und]
    return swapped


def _mismatches(target, reference, ids: torch.Tensor) -> dict[int, int]:
    with make_runner("eager", device=torch.device("cpu")).prepare(target.forward, (ids,), taps=moe_taps(target)) as run:
        taps = run(ids).taps
    uses = observe_expert_use(target, taps, TOL["expert_observation"], reference=reference)
    return {use.layer: len(routing_mismatches(use, ids, START)) for use in uses}


@pytest.mark.parametrize("swapped", [False, True], ids=["correct-loader", "experts-swapped"])
def test_swapped_experts_are_seen_only_by_the_reference_weights(swapped: bool) -> None:
    state = random_state_dict(TINY, 7)
    layer = min(TINY.moe_layers)
    target = ServingARAdapter.build(TINY, _experts_swapped(state, layer) if swapped else state, "cpu", torch.float32)
    reference = ReferenceARAdapter.build(TINY, state, "cpu", torch.float32)
    ids = mixed_ids()
    judged = _mismatches(target, reference, ids)
    blind = _mismatches(target, None, ids)  # the switched-off variant: the target's own modules only
    assert blind == dict.fromkeys(TINY.moe_layers, 0)
    if swapped:
        assert judged[layer] == ids.numel() and all(judged[other] == 0 for other in TINY.moe_layers if other != layer)
    else:
        assert judged == dict.fromkeys(TINY.moe_layers, 0)

"""The AR reference run streamed: the fp64 golden without the whole model in fp64 on the device.

The reference module is built on the meta device and `parity.suites.streaming.StreamedWeights`
brings each unit's weights to the device for that unit's forward only: the embedding tables,
each decoder layer, the final norm and each head (docs/lanes.md §4). The weights come from

* the checkpoint directory, held on the host as the file stores them and cast per unit (the tiny
  configuration: `from_checkpoint`), or
* the seeded draws of `random_state_dict`, drawn on the device per unit and again at every
  forward (the full configuration: `from_draws`; 10.7 B parameters in fp64 would need 79.7 GiB).

Either way a unit gets the tensors the whole model would hold, cast the way the whole model's
loader casts them (`MammothModa2ForCausalLM.from_state_dict`: `.to(device=..., dtype=...)`), and the
module's own forward runs: the streamed golden equals the whole-model golden bit for bit
(tests/models/test_ar_golden_streamed.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from parity.suites.streaming import StreamedWeights, WeightSource
from reference_models import families
from reference_models.ar import release as ar_release
from reference_models.ar.adapter import ReferenceARAdapter
from reference_models.ar.config import MammothModa2ARConfig
from reference_models.ar.model import MammothModa2ForCausalLM
from reference_models.checkpoints import SeededARWeights
from reference_models.common import hf_checkpoint

# fp32 draws become the stored dtype (reference_models/checkpoints.py `init_tensor`)
DRAW_DTYPE = torch.float32


def ar_units(config: MammothModa2ARConfig) -> list[str]:
    """The streamed units of the AR reference: each embedding table, each decoder layer, the final
    norm and each head (module paths of `MammothModa2ForCausalLM`)."""
    tables = ["model.embed_tokens"] + (["model.gen_embed_tokens"] if config.extra_gen_vocab else [])
    heads = ["lm_head"] + (["gen_head"] if config.extra_gen_vocab else [])
    return [*tables, *(f"model.layers.{i}" for i in range(config.num_hidden_layers)), "model.norm", *heads]


def held_weights(state_dict: Mapping[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype) -> WeightSource:
    """Tensors kept where they are (the host) and cast per request as the whole model's loader casts them."""
    return lambda names: {name: state_dict[name].to(device=device, dtype=dtype) for name in names}


class StreamedReference(ReferenceARAdapter):
    """The reference adapter on a meta module whose units take their weights from a source per
    forward; between forwards its parameters are meta tensors (`streamed` says which unit is in)."""

    def __init__(self, config: MammothModa2ARConfig, source: WeightSource, dtype: torch.dtype) -> None:
        with torch.device("meta"):
            module = MammothModa2ForCausalLM(config).to(dtype)
        super().__init__(module)
        self.streamed = StreamedWeights(module, ar_units(config), source)


def from_checkpoint(directory: str | Path, device: torch.device | str, dtype: torch.dtype = torch.float64) -> StreamedReference:
    """The streamed reference of a parity or release directory, its tensors held on the host."""
    config, state, _ = ar_release.load_ar(directory, device="cpu", others=families.others("ar"))
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in MammothModa2ForCausalLM(config).named_parameters()}
    hf_checkpoint.check_state_dict(shapes, state, str(directory))
    return StreamedReference(config, held_weights(state, device, dtype), dtype)


def from_draws(
    config: MammothModa2ARConfig, seed: int, device: torch.device | str, dtype: torch.dtype = torch.float64
) -> StreamedReference:
    """The streamed reference of `random_state_dict(config, seed, device, dtype)`, each unit drawn
    on `device` when its forward starts (the same per-name generators the whole state dict uses)."""
    return StreamedReference(config, SeededARWeights(config, seed, device, dtype), dtype)


def unit_bytes(config: MammothModa2ARConfig, dtype: torch.dtype) -> int:
    """Device memory the streamed golden adds at its peak: the largest unit's weights in `dtype`,
    plus the fp32 draw of that unit's largest tensor (drawn in fp32, then cast)."""
    with torch.device("meta"):
        module = MammothModa2ForCausalLM(config)
    best = 0
    for path in ar_units(config):
        params = [p.numel() for p in module.get_submodule(path).parameters()]
        best = max(best, sum(params) * dtype.itemsize + max(params) * DRAW_DTYPE.itemsize)
    return best


def ar_parameters(config: MammothModa2ARConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in MammothModa2ForCausalLM(config).parameters())

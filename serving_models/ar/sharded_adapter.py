"""The AR adapter of the tensor-parallel serving backbone (`serving_models/ar/sharded.py`).

Every rank of the group holds one of these over its shard; the suites call the same members on
every rank in the same order, and every output is whole on every rank (the heads gather their
logit columns, the row-parallel layers sum), so each rank's rows equal the single-process ones
within rounding. Only what differs from the single-process adapter is here: construction from
a checkpoint (the rank's slices), the KV cache of the rank's heads, and a stage map limited to
the stages every rank holds whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from serving_models.ar import sharded
from serving_models.ar.adapter import STAGE_MAP, ServingARAdapter
from serving_models.ar.model import StaticKVCache

# q/k/v, the rotated heads, the attention output and each expert's gate/up/act are a rank's slice
# (column-parallel), and o_proj's output has the residual fused in: stages parity cannot compare
# with the reference's whole tensors, so they are left undeclared (reported "not observable").
WHOLE_ON_EVERY_RANK = (
    "embed",
    "input_norm",
    "post_norm",
    "mlp.down",
    "gen_mlp.down",
    "moe",
    "out",
    "final_norm",
    "lm_head",
    "gen_head",
)
SHARDED_STAGE_MAP = {stage: where for stage, where in STAGE_MAP.items() if stage.split(".", 2)[-1] in WHOLE_ON_EVERY_RANK}


class ShardedARAdapter(ServingARAdapter):
    stage_map = SHARDED_STAGE_MAP

    def __init__(self, module, tp: sharded.TensorParallel) -> None:
        super().__init__(module)
        self.tp = tp  # the adapter keeps the single-process `name`: its rows are the same cases (`tp` column says how it ran)

    @classmethod
    def load(  # type: ignore[override]
        cls,
        checkpoint_dir: str | Path,
        tp: sharded.TensorParallel,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> ShardedARAdapter:
        tp = sharded.TensorParallel.of(tp)
        return cls(sharded.from_pretrained(checkpoint_dir, tp, device, dtype), tp)

    @classmethod
    def build(  # type: ignore[override]
        cls,
        config: object,
        state_dict: Mapping[str, torch.Tensor],
        tp: sharded.TensorParallel,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> ShardedARAdapter:
        tp = sharded.TensorParallel.of(tp)
        return cls(sharded.load_sharded(config, state_dict, tp, device, dtype), tp)

    def allocate_decode_state(self, batch: int, max_len: int) -> StaticKVCache:
        kv_heads = self.config.num_key_value_heads // self.tp.world_size
        self.decode_state = StaticKVCache.allocate(self.config, batch, max_len, self._device, self._dtype, kv_heads)
        return self.decode_state

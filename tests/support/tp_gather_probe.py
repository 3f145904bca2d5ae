"""Run by `torch.distributed.run --nproc-per-node 2`: the sharded serving AR (tiny) at TP=2 over
gloo, its forward compiled with `fullgraph=True` as the suites' compiled mode does, on whatever
torch runs this. Prints one line per rank: `rank R: compiled ok, chunk-cat calls N` or `rank R:
compiled failed: ...`. `--old-form` puts back the gather along the last dim (the broken variant):
it goes through funcol's `_maybe_view_chunk_cat`, which torch 2.11's Dynamo refuses to trace
(docs/targets.md §11), so its calls are counted here on any torch."""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from reference_models.ar.config import ar_config
from reference_models.checkpoints import random_state_dict
from serving_models.ar import sharded
from serving_models.target import make_target

calls = [0]
chunk_cat = funcol._maybe_view_chunk_cat


def say(line: str) -> None:
    """One write of the whole line: both ranks share torchrun's stdout, and `print` writes the text
    and its newline apart, so under load one rank's line landed inside the other's. A write of
    fewer than PIPE_BUF bytes to a pipe is atomic (POSIX)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def counted(*args, **kwargs):
    calls[0] += 1
    return chunk_cat(*args, **kwargs)


funcol._maybe_view_chunk_cat = counted
if "--old-form" in sys.argv:
    sharded.TensorParallel.all_gather_last = lambda self, tensor: sharded._all_gather(
        tensor.contiguous(), tensor.dim() - 1, self.group
    )

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
rank = dist.get_rank()
tp = sharded.TensorParallel(rank, 2, dist.new_group([0, 1]))
config = ar_config("tiny")
adapter = make_target(tp=tp).build_ar(config, random_state_dict(config, 0), "cpu", torch.float32)
ids = torch.tensor([[3, 17, 42, 7, 99, 5]])
adapter.forward(input_ids=ids)
try:
    torch.compile(adapter.forward, fullgraph=True)(input_ids=ids)
    say(f"rank {rank}: compiled ok, chunk-cat calls {calls[0]}")
except Exception as exc:
    say(f"rank {rank}: compiled failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
dist.destroy_process_group()

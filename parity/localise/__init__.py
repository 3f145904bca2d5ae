"""Where a port diverges: stage vocabularies, stage maps, the stage chain of a failing case, repros.

A target declares in its adapter (`stage_map`) where each stage of its family's vocabulary is in
its model; `parity.localise.chain` judges every stage of a failing case against the fp64 golden
and names the first that diverges while its inputs are within bound (docs/localise.md).
"""

from parity.localise.stages import Call, Tap, fused

__all__ = ["Call", "Tap", "fused"]

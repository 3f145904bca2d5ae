"""`ArchConstant`: a float the architecture fixes (a norm epsilon, a RoPE base, an attention
scale), held so that `torch.compile(dynamic=True)` traces it as a constant.

Under `dynamic=True` Dynamo turns every exact `float` it reads from a module into a symbolic
graph input (`assume_static_by_default` is off). An op that needs a real Python float, such as
`F.rms_norm`'s `eps`, cannot take one, so Dynamo specializes it and restarts the whole analysis of
the frame (pytorch/pytorch#140346): each compile of the AR forward traced twice. Dynamo wraps only
exact `float` that way; a subclass is traced as a constant with a value guard, so a model built
with another epsilon still recompiles rather than reusing a stale graph
(docs/capture-and-compile.md §3, "Restarts").
"""

from __future__ import annotations


class ArchConstant(float):
    """A float Dynamo traces as a guarded constant; arithmetic on it gives plain floats."""

    __slots__ = ()

    def __repr__(self) -> str:
        return float.__repr__(self)

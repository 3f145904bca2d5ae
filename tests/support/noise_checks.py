"""Checks for tests whose two sides are not bit-identical by construction (docs/machine-independence.md).

* A model loaded from a checkpoint against one built from the same state dict: the claim is about
  the loaded state, so `state_differences` compares names, dtypes, shapes and values *bitwise*
  (loading copies bits: that is guaranteed). Their forwards are not: safetensors tensors sit at
  other memory alignments than freshly allocated ones, and CPU GEMM kernels block, hence round,
  by alignment and by vendor. A forward comparison is judged by the noise-floor rule against an
  fp64 golden (`assert_within_noise_floor`).
* Two greedy decodes by different code (two implementations, graph blend vs eager dispatch):
  tokens may legitimately flip where the top two logits are closer than the two sides' rounding.
  `assert_same_greedy` compares tokens and step logits up to the first differing step and accepts
  a flip there only when the measured logit difference at that step explains it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from parity.compare import Tolerance, Verdict, noise_floor_rule

_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of the same width (NaN payloads and -0.0 included)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bool:
        return tensor
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()])


def state_differences(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[str]:
    """Every way two states differ: missing or unexpected names, dtype, shape, then bits."""
    problems = [f"{name}: only in the first state" for name in sorted(a.keys() - b.keys())]
    problems += [f"{name}: only in the second state" for name in sorted(b.keys() - a.keys())]
    for name in sorted(a.keys() & b.keys()):
        x, y = a[name], b[name]
        if x.dtype != y.dtype:
            problems.append(f"{name}: dtype {x.dtype} vs {y.dtype}")
        elif tuple(x.shape) != tuple(y.shape):
            problems.append(f"{name}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
        else:
            differ = _bits(x) != _bits(y)
            if differ.any():
                first = tuple(int(i) for i in differ.nonzero()[0])
                problems.append(f"{name}: {int(differ.sum())}/{x.numel()} values differ bitwise, first at {first}")
    return problems


def adapter_state(adapter: Any) -> dict[str, torch.Tensor]:
    """Parameters and buffers of an adapter's modules (`module`, and a DiT's `decoder`)."""
    state: dict[str, torch.Tensor] = {}
    for attr in ("module", "decoder"):
        module = getattr(adapter, attr, None)
        if module is not None:
            state.update({f"{attr}.{name}": value for name, value in module.state_dict().items()})
    return state


def assert_same_state(a: Any, b: Any) -> None:
    """Two adapters hold the same tensors: names, dtypes, shapes, values bitwise."""
    problems = state_differences(adapter_state(a), adapter_state(b))
    assert not problems, f"{len(problems)} state difference(s): " + "; ".join(problems[:10])


def assert_within_noise_floor(
    golden: torch.Tensor, eager: torch.Tensor, cand: torch.Tensor, tol: Tolerance, *, name: str = "output"
) -> Verdict:
    """`cand` is allclose to `eager` at `tol` or no further from the fp64 `golden` than the noise
    floor (`parity.compare.noise_floor_rule`: 2-3x eager's own error + atol/10)."""
    verdict, _ = noise_floor_rule(golden, eager, cand, tol, name=name)
    assert verdict.ok, verdict.detail
    return verdict


def assert_same_greedy(want: Any, got: Any, **close: Any) -> int | None:
    """Greedy decodes `want` (the truth) and `got` agree up to a tie flip; returns the first step
    where their tokens differ, or None.

    Step logits are compared (`torch.testing.assert_close`, `close` passed on) at every step up to
    and including that step: before it both sides saw the same tokens. At that step each differing
    row's reference margin between its token and the candidate's must be at most twice the measured
    largest logit difference there (a flip the two sides' rounding explains); a wider margin is a
    defect. After it the sequences diverge and nothing more is comparable.
    """
    if want.tokens.shape != got.tokens.shape:
        raise AssertionError(f"token shapes differ: {tuple(want.tokens.shape)} vs {tuple(got.tokens.shape)}")
    differs = (want.tokens != got.tokens).any(dim=0)
    first = int(differs.nonzero()[0, 0]) if differs.any() else None
    upto = want.tokens.shape[1] if first is None else first + 1
    torch.testing.assert_close(got.step_logits[:, :upto], want.step_logits[:, :upto], **close)
    if first is None:
        return None
    for row in (want.tokens[:, first] != got.tokens[:, first]).nonzero()[:, 0].tolist():
        ref = want.step_logits[row, first].double()
        noise = float((got.step_logits[row, first].double() - ref).abs().max())
        mine, theirs = int(want.tokens[row, first]), int(got.tokens[row, first])
        margin = float(ref[mine] - ref[theirs])
        assert margin <= 2 * noise, (
            f"row {row} step {first}: token {theirs} instead of {mine}, reference margin {margin:.3g} is more "
            f"than twice the measured logit difference {noise:.3g}: not a tie flip"
        )
    return first


# Inductor computes the routers' keys with its own exp / sigmoid: a few fp32 ulps off ATen's
# (measured 4.5e-8 on weights <= 2.5), so a differing decision is accepted where the reference
# margin is within this many spacings of the logits' dtype (the routing grid's own rule).
ROUTING_TIE_SPACINGS = 2.0


def routing_tie_flips(
    logits: torch.Tensor,
    want_ids: torch.Tensor,
    got_ids: torch.Tensor,
    k: int,
    options: dict[str, Any],
    spacings: float = ROUTING_TIE_SPACINGS,
) -> list[int]:
    """Rows whose routed ids differ between two routers of the same keys computed by different
    kernels; asserts every one is a tie flip (margin above 0 and within `spacings`), returns them."""
    from parity.suites.routing.support import audit_decisions

    decisions = audit_decisions(logits, want_ids, got_ids, k, options, spacings=spacings, exact=False)
    wide = [d for d in decisions if d.verdict != "tie_flip"]
    assert not wide, f"{len(wide)} routing decision(s) differ outside the noise: {wide[:5]}"
    return [d.row for d in decisions]

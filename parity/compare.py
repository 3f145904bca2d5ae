"""Tensor comparison: the numbers a reviewer needs to judge a difference, and the rules that judge it.

`diff(ref, cand, tol)` measures two tensors (max / mean abs, relative L2, cosine, ULP distance in
the candidate's dtype, argmax / top-k agreement over the last dim, the first element and row over
tolerance, non-finite counts). `compare(ref, cand, tol)` walks nested outputs (dicts, tuples,
per-layer lists, dataclasses) and returns one `TensorDiff` per leaf, in order, so the first
diverging layer is the first failing leaf. Two rules turn a diff into a `Verdict`:

* `allclose_rule`: plain `|cand - ref| <= atol + rtol * |ref|` element-wise.
* `noise_floor_rule`: the candidate's RMSE against an fp64 golden may be at most `multiplier`
  times the eager reference's RMSE against the same golden, plus a floor (`tol / 10`): the rule of
  `torch._dynamo.utils.same`. Its bound is *measured* (`Verdict.bound`), not a policy.

Non-finite values never raise: they give a `fail` verdict whose detail says "non-finite".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

# Verdict values of a report row (README "Reports"). `not_applicable`: the check cannot apply to
# this target or lane (the reason is in the detail); it is neither a pass nor a failure.
PASS, FAIL, TIE_FLIP, ERROR, NOT_APPLICABLE = "pass", "fail", "tie_flip", "error", "not_applicable"
VERDICTS = (PASS, FAIL, TIE_FLIP, ERROR, NOT_APPLICABLE)
# How a row's bound was set (the report's `bound` column): FIXED is a policy (a case-file tolerance,
# an expected count) that only changes when someone changes it; MEASURED is derived from noise
# measured in the same run (the noise-floor rule's multiplier x RMSE(golden, eager) + floor), so it
# moves with the machine's kernels. A baseline comparison treats the two differently
# (parity.baseline, docs/machine-independence.md).
FIXED, MEASURED = "fixed", "measured"
BOUND_KINDS = (FIXED, MEASURED, "")

_FLOAT_BITS = {
    torch.float16: (torch.int16, 16),
    torch.bfloat16: (torch.int16, 16),
    torch.float32: (torch.int32, 32),
    torch.float64: (torch.int64, 64),
}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """An atol / rtol pair and the reason it is what it is (every bound states its reason)."""

    atol: float
    rtol: float
    reason: str

    def __post_init__(self) -> None:
        if self.atol < 0 or self.rtol < 0:
            raise ValueError(f"tolerance must be non-negative, got atol={self.atol} rtol={self.rtol}")
        if not self.reason.strip():
            raise ValueError("a tolerance needs a stated reason")

    def describe(self) -> str:
        return f"atol={self.atol:g} rtol={self.rtol:g} ({self.reason})"


EXACT = Tolerance(0.0, 0.0, "bitwise: both sides run the same ops on the same shapes")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of one check, carrying the number it was decided on and the bound it met."""

    verdict: str
    metric: str
    value: float
    threshold: float | None
    detail: str = ""
    bound: str | None = None  # FIXED or MEASURED; None: FIXED when there is a threshold, else ''

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.bound is None:
            object.__setattr__(self, "bound", FIXED if self.threshold is not None else "")
        if self.bound not in BOUND_KINDS:
            raise ValueError(f"bound must be one of {BOUND_KINDS}, got {self.bound!r}")

    @property
    def ok(self) -> bool:
        """A tie flip is not a defect (the decision was inside the dtype's noise); a check that
        does not apply is not one either."""
        return self.verdict in (PASS, TIE_FLIP, NOT_APPLICABLE)


@dataclasses.dataclass(frozen=True)
class TensorDiff:
    """Everything measured about one pair of tensors (one leaf of a nested output)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    max_abs: float
    mean_abs: float
    rel_l2: float
    cosine: float
    max_ulp: int
    argmax_agree: float | None
    topk_agree: float | None
    n_bad: int
    first_bad_index: tuple[int, ...] | None
    first_bad_row: int | None
    nonfinite_ref: int
    nonfinite_cand: int
    nonfinite_mismatch: int
    tol: Tolerance

    @property
    def ok(self) -> bool:
        return self.n_bad == 0 and self.nonfinite_mismatch == 0

    def verdict(self, metric: str = "max_abs") -> Verdict:
        """The allclose verdict of this leaf, reported on `metric` with the bound it was held to."""
        value = float(getattr(self, metric))
        if self.nonfinite_mismatch:
            return Verdict(FAIL, metric, value, self.tol.atol, f"{self.name}: non-finite: {self.summary()}")
        if self.n_bad:
            return Verdict(FAIL, metric, value, self.tol.atol, f"{self.name}: {self.summary()}")
        return Verdict(PASS, metric, value, self.tol.atol, f"{self.name}: {self.summary()}")

    def summary(self) -> str:
        parts = [
            f"max_abs={self.max_abs:.3g}",
            f"rel_l2={self.rel_l2:.3g}",
            f"cos={self.cosine:.6f}",
            f"max_ulp={self.max_ulp}",
        ]
        if self.nonfinite_ref or self.nonfinite_cand:
            parts.append(
                f"non-finite ref={self.nonfinite_ref} cand={self.nonfinite_cand} "
                f"mismatched={self.nonfinite_mismatch}"
            )
        if self.n_bad:
            parts.append(
                f"{self.n_bad}/{self.numel} over {self.tol.describe()}, first at index "
                f"{self.first_bad_index} (row {self.first_bad_row})"
            )
        if self.argmax_agree is not None:
            parts.append(f"argmax_agree={self.argmax_agree:.4f}")
        return " ".join(parts)


# ---------------------------------------------------------------------------------------------
# Single tensors
# ---------------------------------------------------------------------------------------------


def _ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """Map floats to integers whose order is the float order, so |a - b| counts representable steps.

    Negative floats have the sign bit set; flipping them onto the negative integers (and +0 / -0
    onto 0) makes adjacent floats differ by exactly 1.
    """
    int_dtype, bits = _FLOAT_BITS[x.dtype]
    raw = x.contiguous().view(int_dtype).to(torch.int64)
    if bits == 64:
        return torch.where(raw < 0, -(raw & torch.iinfo(torch.int64).max), raw)
    raw = raw & ((1 << bits) - 1)  # reinterpret as unsigned of that width
    sign = 1 << (bits - 1)
    return torch.where(raw >= sign, -(raw - sign), raw)


def ulp_distance(ref: torch.Tensor, cand: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Element-wise distance in units in the last place of `dtype` (default: the candidate's).

    Both tensors are rounded to `dtype` first, so an fp32 reference against a bf16 candidate is
    measured in bf16 steps. Non-finite pairs give 0 when equal, the int64 max otherwise.
    """
    dtype = dtype or cand.dtype
    if dtype not in _FLOAT_BITS:
        raise TypeError(f"ULP distance needs a float dtype (bf16/fp16/fp32/fp64), got {dtype}")
    a, b = ref.detach().to(dtype), cand.detach().to(dtype)
    dist = (_ordered_bits(a) - _ordered_bits(b)).abs()
    finite = torch.isfinite(a) & torch.isfinite(b)
    same_nonfinite = ~finite & ((a == b) | (torch.isnan(a) & torch.isnan(b)))
    big = torch.iinfo(torch.int64).max
    return torch.where(finite, dist, torch.where(same_nonfinite, 0, big))


def _leading_row(index: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Flat index of the row (all dims but the last) that holds element `index`."""
    if len(shape) <= 1:
        return 0
    row = 0
    for i, size in zip(index[:-1], shape[:-1]):
        row = row * size + i
    return row


def _topk_agreement(ref: torch.Tensor, cand: torch.Tensor, k: int) -> float:
    k = min(k, ref.shape[-1])
    r = ref.reshape(-1, ref.shape[-1]).topk(k, dim=-1).indices.sort(dim=-1).values
    c = cand.reshape(-1, cand.shape[-1]).topk(k, dim=-1).indices.sort(dim=-1).values
    return float((r == c).all(dim=-1).double().mean())


def diff(
    ref: torch.Tensor,
    cand: torch.Tensor,
    tol: Tolerance = EXACT,
    *,
    name: str = "output",
    topk: int = 5,
    equal_nan: bool = False,
) -> TensorDiff:
    """Measure `cand` against `ref`. Shapes must match; dtypes may differ (compared in fp64)."""
    if tuple(ref.shape) != tuple(cand.shape):
        raise ValueError(f"{name}: shape mismatch: reference {tuple(ref.shape)} vs candidate {tuple(cand.shape)}")
    shape = tuple(ref.shape)
    numel = ref.numel()
    is_float = ref.is_floating_point() or cand.is_floating_point()
    r = ref.detach().to("cpu", torch.float64)
    c = cand.detach().to("cpu", torch.float64)

    fin_r, fin_c = torch.isfinite(r), torch.isfinite(c)
    both_finite = fin_r & fin_c
    # Equal infinities match (e.g. logits masked to -inf on both sides); NaN matches only if asked.
    same_nonfinite = ~both_finite & ((r == c) | (equal_nan & torch.isnan(r) & torch.isnan(c)))
    nonfinite_mismatch = int((~both_finite & ~same_nonfinite).sum())

    zero = torch.zeros((), dtype=torch.float64)
    err = torch.where(both_finite, (c - r).abs(), zero)
    bound = tol.atol + tol.rtol * torch.where(both_finite, r.abs(), zero)
    bad = (both_finite & (err > bound)) | (~both_finite & ~same_nonfinite)
    n_bad = int(bad.sum())
    first_bad_index = first_bad_row = None
    if n_bad:
        flat = int(bad.reshape(-1).nonzero()[0, 0])
        first_bad_index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if shape else ()
        first_bad_row = _leading_row(first_bad_index, shape)

    rf = torch.where(both_finite, r, zero)
    cf = torch.where(both_finite, c, zero)
    max_abs = float(err.max()) if numel else 0.0
    mean_abs = float(err.mean()) if numel else 0.0
    ref_norm = float(rf.norm())
    diff_norm = float((cf - rf).norm())
    rel_l2 = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    cand_norm = float(cf.norm())
    if ref_norm > 0 and cand_norm > 0:
        cosine = float((rf * cf).sum()) / (ref_norm * cand_norm)
    else:
        cosine = 1.0 if ref_norm == cand_norm else 0.0

    if is_float:
        ulp_dtype = cand.dtype if cand.dtype in _FLOAT_BITS else torch.float32
        ulp = ulp_distance(ref.detach().cpu(), cand.detach().cpu(), ulp_dtype)
        max_ulp = int(ulp.max()) if numel else 0
    else:
        max_ulp = int(err.max()) if numel else 0

    argmax_agree = topk_agree = None
    if is_float and len(shape) >= 1 and shape[-1] > 1 and numel:
        rr, cc = rf.reshape(-1, shape[-1]), cf.reshape(-1, shape[-1])
        argmax_agree = float((rr.argmax(-1) == cc.argmax(-1)).double().mean())
        topk_agree = _topk_agreement(rr, cc, topk)

    return TensorDiff(
        name=name,
        shape=shape,
        dtype=str(cand.dtype).removeprefix("torch."),
        numel=numel,
        max_abs=max_abs,
        mean_abs=mean_abs,
        rel_l2=rel_l2,
        cosine=cosine,
        max_ulp=max_ulp,
        argmax_agree=argmax_agree,
        topk_agree=topk_agree,
        n_bad=n_bad,
        first_bad_index=first_bad_index,
        first_bad_row=first_bad_row,
        nonfinite_ref=int((~fin_r).sum()),
        nonfinite_cand=int((~fin_c).sum()),
        nonfinite_mismatch=nonfinite_mismatch,
        tol=tol,
    )


# ---------------------------------------------------------------------------------------------
# Nested outputs
# ---------------------------------------------------------------------------------------------


def flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield (path, leaf) pairs of a nested output in a stable order: `hidden_states[3]`, `['k']`."""
    if isinstance(tree, torch.Tensor) or tree is None or isinstance(tree, (int, float, bool, str)):
        yield prefix or "output", tree
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for field in dataclasses.fields(tree):
            yield from flatten(getattr(tree, field.name), f"{prefix}.{field.name}" if prefix else field.name)
    elif hasattr(tree, "_fields") and isinstance(tree, tuple):  # NamedTuple
        for key in tree._fields:
            yield from flatten(getattr(tree, key), f"{prefix}.{key}" if prefix else key)
    elif isinstance(tree, Mapping):
        for key in tree:
            yield from flatten(tree[key], f"{prefix}[{key!r}]")
    elif isinstance(tree, Sequence):
        for i, item in enumerate(tree):
            yield from flatten(item, f"{prefix}[{i}]")
    else:
        raise TypeError(f"{prefix or 'output'}: cannot compare a {type(tree).__name__}")


@dataclasses.dataclass(frozen=True)
class TreeDiff:
    """Per-leaf diffs of two nested outputs plus any structural mismatch, in traversal order."""

    leaves: tuple[TensorDiff, ...]
    structure_errors: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.structure_errors and all(leaf.ok for leaf in self.leaves)

    def first_failing(self) -> TensorDiff | None:
        """The first leaf over tolerance: with per-layer lists, the first diverging layer."""
        return next((leaf for leaf in self.leaves if not leaf.ok), None)

    def worst(self, metric: str = "max_abs") -> TensorDiff | None:
        return max(self.leaves, key=lambda leaf: getattr(leaf, metric), default=None)

    def verdict(self, metric: str = "max_abs") -> Verdict:
        if self.structure_errors:
            return Verdict(FAIL, "structure", float(len(self.structure_errors)), 0.0, "; ".join(self.structure_errors))
        bad = self.first_failing()
        if bad is not None:
            v = bad.verdict(metric)
            return dataclasses.replace(v, detail=f"first diverging: {v.detail}")
        worst = self.worst(metric)
        if worst is None:
            return Verdict(PASS, metric, 0.0, None, "no tensors to compare")
        return worst.verdict(metric)


def compare(ref: Any, cand: Any, tol: Tolerance = EXACT, **diff_kwargs: Any) -> TreeDiff:
    """Diff two nested outputs leaf by leaf; structure mismatches are reported, not raised."""
    ref_leaves = dict(flatten(ref))
    cand_leaves = dict(flatten(cand))
    errors = [f"{k}: missing in candidate" for k in ref_leaves if k not in cand_leaves]
    errors += [f"{k}: unexpected in candidate" for k in cand_leaves if k not in ref_leaves]
    leaves = []
    for key, r in ref_leaves.items():
        if key not in cand_leaves:
            continue
        c = cand_leaves[key]
        if r is None and c is None:
            continue
        if not isinstance(r, torch.Tensor) or not isinstance(c, torch.Tensor):
            if r != c:
                errors.append(f"{key}: {r!r} != {c!r}")
            continue
        if tuple(r.shape) != tuple(c.shape):
            errors.append(f"{key}: shape {tuple(r.shape)} vs {tuple(c.shape)}")
            continue
        leaves.append(diff(r, c, tol, name=key, **diff_kwargs))
    return TreeDiff(tuple(leaves), tuple(errors))


# ---------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------


def allclose_rule(ref: torch.Tensor, cand: torch.Tensor, tol: Tolerance, *, name: str = "output") -> Verdict:
    """Plain atol/rtol: every element within `atol + rtol * |ref|`, non-finite values matching."""
    return diff(ref, cand, tol, name=name).verdict("max_abs")


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """Root-mean-square error in fp64 over finite pairs; inf when a pair is non-finite."""
    a64, b64 = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    if not (torch.isfinite(a64).all() and torch.isfinite(b64).all()):
        return math.inf
    return float(((a64 - b64) ** 2).mean().sqrt()) if a64.numel() else 0.0


def noise_floor_multiplier(dtype: torch.dtype, numel: int) -> float:
    """The multiplier of `torch._dynamo.utils.same`: 2 for fp32, 3 for fp16/bf16 and small tensors.

    Source comment there: AMP-vs-fp32 end-to-end accuracy differs by < 0.1%, so 3 avoids false
    alarms in half precision; tensors under 1000 elements get 3 as well (their RMSE is noisier).
    """
    if dtype in (torch.float16, torch.bfloat16) or numel < 1000:
        return 3.0
    return 2.0


@dataclasses.dataclass(frozen=True)
class NoiseFloor:
    """The numbers the noise-floor rule was decided on, for the report."""

    ref_error: float  # RMSE(golden, eager reference in the candidate's dtype)
    res_error: float  # RMSE(golden, candidate)
    multiplier: float
    floor: float
    threshold: float  # multiplier * ref_error + floor
    ratio: float  # res_error / ref_error
    allclose: bool  # passed the plain atol/rtol pre-check


def noise_floor_rule(
    golden: torch.Tensor,
    eager: torch.Tensor,
    cand: torch.Tensor,
    tol: Tolerance,
    *,
    multiplier: float | None = None,
    name: str = "output",
) -> tuple[Verdict, NoiseFloor]:
    """Judge `cand` by how far it is from an fp64 `golden`, relative to the eager reference's error.

    Pass if `cand` is allclose to `eager`, or if `RMSE(golden, cand) <= multiplier *
    RMSE(golden, eager) + atol / 10`. The candidate may be as noisy as the dtype makes the eager
    reference, not noisier. Non-finite candidates fail with "non-finite" in the detail.
    """
    if multiplier is None:
        multiplier = noise_floor_multiplier(cand.dtype, cand.numel())
    floor = tol.atol / 10.0
    close = diff(eager, cand, tol, name=name).ok
    ref_error = rmse(golden, eager)
    res_error = rmse(golden, cand)
    threshold = multiplier * ref_error + floor
    ratio = res_error / ref_error if ref_error > 0 else (0.0 if res_error == 0 else math.inf)
    record = NoiseFloor(ref_error, res_error, multiplier, floor, threshold, ratio, close)
    summary = (
        f"{name}: rmse(golden,cand)={res_error:.3g} rmse(golden,eager)={ref_error:.3g} "
        f"ratio={ratio:.3g} threshold={multiplier:g}*{ref_error:.3g}+{floor:.3g}"
    )
    cand_nonfinite = int((~torch.isfinite(cand.detach().float())).sum())
    # The threshold is measured (the eager reference's error in this run, on this machine's kernels).
    if cand_nonfinite:
        return Verdict(FAIL, "rmse_vs_golden", res_error, threshold, f"non-finite: {cand_nonfinite} values; {summary}", MEASURED), record
    if close or res_error <= threshold:
        how = "allclose to eager" if close else "within noise floor"
        return Verdict(PASS, "rmse_vs_golden", res_error, threshold, f"{how}; {summary}", MEASURED), record
    return Verdict(FAIL, "rmse_vs_golden", res_error, threshold, f"above noise floor; {summary}", MEASURED), record


def dtype_spacing(value: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """Distance from |value| to the next representable number of `dtype` (one ULP at that magnitude)."""
    v = torch.as_tensor(value, dtype=torch.float64).abs().to(dtype)
    up = torch.nextafter(v, torch.full_like(v, math.inf))
    return (up.to(torch.float64) - v.to(torch.float64)).abs()


def classify_decision(margin: float, magnitude: float, dtype: torch.dtype, spacings: float = 2.0) -> str:
    """`tie_flip` when a differing top-1 (or k-th vs k+1-th) decision's margin is inside the noise.

    The margin is compared with `spacings` ULPs of `dtype` at the decision's magnitude (practice.md
    section 2: spacing scales with magnitude, so a fixed gap misfires on large logits).
    """
    noise = spacings * float(dtype_spacing(magnitude, dtype))
    return TIE_FLIP if margin <= noise else FAIL

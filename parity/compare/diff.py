"""Measuring a difference: one pair of tensors (`diff`) or two nested outputs leaf by leaf (`compare`).

`diff(ref, cand, tol)` measures max / mean abs, relative L2, cosine, ULP distance in the
candidate's dtype, argmax / top-k agreement over the last dim, the first element and row over
tolerance and non-finite counts. `compare(ref, cand, tol)` walks nested outputs (dicts, tuples,
per-layer lists, dataclasses) and returns one `TensorDiff` per leaf, in order, so the first
diverging layer is the first failing leaf. Non-finite values never raise: a mismatch is a `fail`
whose detail says "non-finite".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from parity.compare.verdict import EXACT, FAIL, PASS, Tolerance, Verdict

_FLOAT_BITS = {
    torch.float16: (torch.int16, 16),
    torch.bfloat16: (torch.int16, 16),
    torch.float32: (torch.int32, 32),
    torch.float64: (torch.int64, 64),
}


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
            parts.append(f"non-finite ref={self.nonfinite_ref} cand={self.nonfinite_cand} mismatched={self.nonfinite_mismatch}")
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
    """Measure `cand` against `ref`. Shapes must match; floating dtypes may differ (compared in
    fp64), but a floating side against an integer or bool one is a wrong-dtype output, refused."""
    if tuple(ref.shape) != tuple(cand.shape):
        raise ValueError(f"{name}: shape mismatch: reference {tuple(ref.shape)} vs candidate {tuple(cand.shape)}")
    if ref.is_floating_point() != cand.is_floating_point():
        raise ValueError(
            f"{name}: dtype mismatch: reference {ref.dtype} vs candidate {cand.dtype} (floating against non-floating)"
        )
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
    elif isinstance(tree, tuple) and hasattr(tree, "_fields"):  # NamedTuple
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

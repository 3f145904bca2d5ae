"""Fused decode kernels of the serving AR model (Triton, CUDA only), with the torch ops they replace.

A batch-1 decode step reads each weight once; what it spends beyond that is small kernels and the
gaps between them. Profiled on the H200 (docs/gpu-results.md), the step's non-GEMM work was about
two thirds of a millisecond in launches of a few microseconds each: RMSNorm then its weight
multiply, RoPE as multiplies, a concatenation and an add, the KV-cache write as two scatters, SiLU
then the gate multiply. Each function here does one of those stages in one kernel:

- `rms_norm(x, weight, eps)`: `weight * rms_norm(x)` (two launches -> one);
- `rope_and_cache_write(...)`: rotate q and k of the fused qkv output, write the rotated k and the
  v into the static KV cache at their positions, return q (six launches -> one);
- `silu_and_mul(gate_up)`: `silu(gate) * up` of the fused gate|up output (two launches -> one).

Same rounding as the torch ops: every intermediate the torch version rounds to the model's dtype is
rounded here at the same point (a product of two bf16 values is exact in fp32, so the rounded RoPE
is bit for bit torch's); only the reductions (RMSNorm's mean of squares) and the transcendental
functions (rsqrt, exp) may differ in the last fp32 bit, which at most flips one rounding of the
output. tests/models/test_ar_kernels.py checks both against the torch ops.

The kernels run where Triton is installed, the tensors are on CUDA in bf16, fp16 or fp32, and no
torch.compile trace is running (Inductor fuses the torch ops itself, and the compiled graphs stay
free of opaque calls). Everywhere else (the CPU lane, the fp64 golden, a compiled forward) the
torch ops run. Each kernel is a `torch.library` custom op, so a dispatch mode sees the weights
they read (the weight-coverage check) and a CUDA graph captures them like any other op.
`PARITY_FUSED_KERNELS=0` turns them off (a benchmark's unfused baseline, a bisect).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; the CPU lane runs the torch ops
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ENV_SWITCH = "PARITY_FUSED_KERNELS"


def _interpreted() -> bool:
    """With TRITON_INTERPRET=1 Triton's interpreter runs the kernels on CPU tensors: a check of their
    logic without a GPU (fp16 and fp32 only: the interpreter rounds to bf16 its own way)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def fused(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernel serves these tensors (see the module docstring for when)."""
    # is_compiling first: a Dynamo trace reads nothing else here (no guard on the environment)
    if torch.compiler.is_compiling() or triton is None or os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    first = tensors[0]
    on_device = first.is_cuda or (_interpreted() and first.device.type == "cpu")
    return on_device and all(t.dtype == first.dtype for t in tensors) and first.dtype in FUSED_DTYPES


@contextmanager
def unfused() -> Iterator[None]:
    """The torch ops everywhere while the block runs (what a forward traced or captured inside it bakes)."""
    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV_SWITCH]
        else:
            os.environ[ENV_SWITCH] = before


# ----------------------------------------------------------------------------------------------
# The torch ops each kernel replaces (and the path everywhere the kernels do not run)
# ----------------------------------------------------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Upstream's `weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)` with `h` upcast to fp32:
    `F.rms_norm` without a weight computes in fp32 and rounds where upstream does, and the weight
    multiplies the rounded result, as upstream's does."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rotate_half_torch(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [B, L, heads, D]; cos, sin_signed: [B, L, 1, D] (sin with the sign of
    rotate-half folded into its first half). `x * cos + cat(x2, x1) * sin_signed` is upstream's
    `x * cos + cat(-x2, x1) * sin` element for element (moving a sign between factors is exact)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin_signed


def rope_and_cache_write_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """qkv `[B, L, (heads + 2 kv) * D]`, caches `[B, kv, max_len, D]`: rotate q and k (adjacent
    columns: one RoPE pass), write k and v at `positions` `[B, L]`, return q `[B, L, heads, D]`."""
    bsz, q_len = qkv.shape[:2]
    kv_heads, dim = key_cache.shape[1], key_cache.shape[3]
    qk = qkv[..., : (heads + kv_heads) * dim].view(bsz, q_len, heads + kv_heads, dim)
    qk = rotate_half_torch(qk, cos, sin_signed)
    v = qkv[..., (heads + kv_heads) * dim :].view(bsz, q_len, kv_heads, dim)
    k = qk[:, :, heads:].transpose(1, 2)
    write_cache_torch(key_cache, positions, k)
    write_cache_torch(value_cache, positions, v.transpose(1, 2))
    return qk[:, :, :heads]


def write_cache_torch(cache: torch.Tensor, positions: torch.Tensor, x: torch.Tensor) -> None:
    """Write `x` `[B, KV, L, D]` into `cache` `[B, KV, max_len, D]` at `positions` `[B, L]`, in place.

    An indexed assignment (`index_put_`), not `scatter_`: Inductor keeps an `index_put_` into a
    graph input in place, while it turns a `scatter_` into a copy of the whole cache, the write,
    attention over the copy and a copy back at the graph's end (docs/model.md §4)."""
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]
    cache[rows, :, positions] = x.transpose(1, 2)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a fused `[..., 2 * I]` gate|up output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------------------------
# Triton kernels (one program per row, or per row and head)
# ----------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_row_stride, dim, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < dim
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
        mean_square = tl.sum(x * x, axis=0) / dim
        normed = (x * tl.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)  # F.rms_norm's rounding
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * dim + cols, (normed.to(tl.float32) * w).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _rope_cache_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        q_len,
        heads,
        kv_heads,
        max_len,
        qkv_row_stride,
        trig_row_stride,
        pos_b_stride,
        pos_l_stride,
        DIM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)  # b * q_len + l
        head = tl.program_id(1)  # q heads, then k heads, then v heads
        b = row // q_len
        l_ = row - b * q_len
        cols = tl.arange(0, BLOCK)
        inside = cols < DIM
        dtype = q_ptr.dtype.element_ty
        x = tl.load(qkv_ptr + row * qkv_row_stride + head * DIM + cols, mask=inside, other=0.0)
        position = tl.load(pos_ptr + b * pos_b_stride + l_ * pos_l_stride)
        # A position outside the cache is not written (torch's scatter would raise a device-side
        # assert); the caller's positions are < max_len by contract.
        slot_position = cols * 0 + position
        in_cache = inside & (slot_position >= 0) & (slot_position < max_len)
        if head < heads + kv_heads:
            half = DIM // 2
            partner = tl.where(cols < half, cols + half, cols - half)
            x_partner = tl.load(qkv_ptr + row * qkv_row_stride + head * DIM + partner, mask=inside, other=0.0)
            c = tl.load(cos_ptr + row * trig_row_stride + cols, mask=inside, other=0.0)
            s = tl.load(sin_ptr + row * trig_row_stride + cols, mask=inside, other=0.0)
            # torch rounds each product and the sum to the model's dtype: so do we
            x_cos = (x.to(tl.float32) * c.to(tl.float32)).to(dtype)
            x_sin = (x_partner.to(tl.float32) * s.to(tl.float32)).to(dtype)
            rotated = (x_cos.to(tl.float32) + x_sin.to(tl.float32)).to(dtype)
            if head < heads:
                tl.store(q_ptr + (row * heads + head) * DIM + cols, rotated, mask=inside)
            else:
                slot = ((b * kv_heads + head - heads) * max_len + position) * DIM
                tl.store(k_cache_ptr + slot + cols, rotated, mask=in_cache)
        else:
            slot = ((b * kv_heads + head - heads - kv_heads) * max_len + position) * DIM
            tl.store(v_cache_ptr + slot + cols, x, mask=in_cache)

    @triton.jit
    def _silu_and_mul_kernel(gate_up_ptr, out_ptr, size, gate_up_row_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < size
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(gate_up_ptr + row * gate_up_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * gate_up_row_stride + size + cols, mask=inside, other=0.0).to(tl.float32)
        # libdevice's exp (as accurate as CUDA's expf that F.silu calls): tl.exp is ex2.approx of
        # x * log2(e), whose rounded argument costs up to ~14 fp32 ulps at |x| = 16 (measured on the H200)
        silu = (gate / (1.0 + libdevice.exp(-gate))).to(dtype)  # F.silu's rounding, then the product's
        tl.store(out_ptr + row * size + cols, (silu.to(tl.float32) * up).to(dtype), mask=inside)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as `[rows, last dim]` with unit stride along the last dim (a copy only if it must)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


# ----------------------------------------------------------------------------------------------
# Custom ops: a dispatch mode sees their inputs, a CUDA graph captures them
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("parity_serving::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    dim = rows.shape[1]
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, out, rows.stride(0), dim, eps, BLOCK=triton.next_power_of_2(dim), num_warps=8 if dim >= 2048 else 4
    )
    return out.view(x.shape)


@_rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("parity_serving::rope_and_cache_write", mutates_args=("key_cache", "value_cache"))
def _rope_and_cache_write_op(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    bsz, q_len = qkv.shape[:2]
    kv_heads, max_len, dim = key_cache.shape[1:]
    rows = _rows(qkv)
    cos_rows, sin_rows = _rows(cos.expand(bsz, q_len, 1, dim)), _rows(sin_signed.expand(bsz, q_len, 1, dim))
    q = torch.empty((bsz, q_len, heads, dim), dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(bsz * q_len, heads + 2 * kv_heads)](
        rows,
        cos_rows,
        sin_rows,
        positions,
        q,
        key_cache,
        value_cache,
        q_len,
        heads,
        kv_heads,
        max_len,
        rows.stride(0),
        cos_rows.stride(0),
        positions.stride(0),
        positions.stride(1),
        DIM=dim,
        BLOCK=triton.next_power_of_2(dim),
        num_warps=1 if dim <= 128 else 2,
        enable_fp_fusion=False,  # torch multiplies and adds in separate kernels: no fused multiply-add
    )
    return q


@_rope_and_cache_write_op.register_fake
def _(qkv, cos, sin_signed, positions, key_cache, value_cache, heads):
    return qkv.new_empty((qkv.shape[0], qkv.shape[1], heads, key_cache.shape[3]))


@torch.library.custom_op("parity_serving::silu_and_mul", mutates_args=())
def _silu_and_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    rows = _rows(gate_up)
    size = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], size), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(size))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, block))](rows, out, size, rows.stride(0), BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], size)


@_silu_and_mul_op.register_fake
def _(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


# ----------------------------------------------------------------------------------------------
# What the model calls: the kernel where it serves, the torch ops elsewhere
# ----------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * rms_norm(x)` over the last dim, rounded as upstream rounds."""
    if fused(x, weight):
        return _rms_norm_op(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def rope_and_cache_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """Rotated q `[B, L, heads, D]`; rotated k and v written into the caches at `positions`."""
    if fused(qkv, cos, sin_signed, key_cache, value_cache) and key_cache.is_contiguous() and value_cache.is_contiguous():
        return _rope_and_cache_write_op(qkv, cos, sin_signed, positions, key_cache, value_cache, heads)
    return rope_and_cache_write_torch(qkv, cos, sin_signed, positions, key_cache, value_cache, heads)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a fused gate|up output `[..., 2 * I]` -> `[..., I]`."""
    if fused(gate_up):
        return _silu_and_mul_op(gate_up)
    return silu_and_mul_torch(gate_up)

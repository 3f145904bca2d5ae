"""The serving model's fused CUDA decode kernels against the torch ops they replace.

RoPE with the KV-cache write rounds exactly where the torch ops round (the products of two values
of the model's dtype are exact in fp32, the kernel is built without fused multiply-add), so it must
equal them bit for bit. RMSNorm and SiLU-times-up reduce and call rsqrt / exp in fp32 in their own
way, so their bound is the torch ops' own error against fp64 in the same run plus what that can
move: see `rounding_slack`. Each check is shown to fail on a broken kernel call.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from reference_models.ar.config import ar_config
from reference_models.checkpoints import random_state_dict
from serving_models.ar import kernels
from serving_models.ar.adapter import ServingARAdapter

pytestmark = pytest.mark.parity_gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SIZES = ["tiny", "full"]
BATCH_LENGTHS = [(1, 1), (3, 5)]  # a decode step, and a prefill chunk of several sequences


@pytest.fixture(autouse=True)
def _kernels_serve_cuda() -> None:
    probe = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    assert kernels.fused(probe), "the fused kernels must serve bf16 CUDA tensors here (Triton installed with CUDA torch)"


def rope_inputs(size: str, dtype: torch.dtype, batch: int, length: int, seed: int = 0):
    config = ar_config(size)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    generator = torch.Generator(device="cuda").manual_seed(seed)
    max_len = 4 * length + 8
    qkv = torch.randn(batch, length, (heads + 2 * kv_heads) * dim, device="cuda", generator=generator).to(dtype)
    positions = torch.stack([torch.randperm(max_len, device="cuda", generator=generator)[:length] for _ in range(batch)])
    angles = positions[..., None].double() * torch.rand(dim, device="cuda", generator=generator, dtype=torch.float64) * 3
    sin = angles.sin().to(dtype)
    sin_signed = torch.cat((-sin[..., : dim // 2], sin[..., dim // 2 :]), dim=-1)
    cache = torch.randn(2, batch, kv_heads, max_len, dim, device="cuda", generator=generator).to(dtype)
    return qkv, angles.cos().to(dtype)[:, :, None], sin_signed[:, :, None], positions, cache, heads


def rope_mismatches(call: Callable[..., torch.Tensor], size: str, dtype: torch.dtype, batch: int, length: int) -> dict[str, int]:
    """Elements of q, the key cache and the value cache where `call` differs from the torch ops."""
    qkv, cos, sin_signed, positions, cache, heads = rope_inputs(size, dtype, batch, length)
    want_cache, got_cache = cache.clone(), cache.clone()
    want_q = kernels.rope_and_cache_write_torch(qkv, cos, sin_signed, positions, want_cache[0], want_cache[1], heads)
    got_q = call(qkv, cos, sin_signed, positions, got_cache[0], got_cache[1], heads)
    return {
        "q": int((got_q != want_q).sum()),
        "keys": int((got_cache[0] != want_cache[0]).sum()),
        "values": int((got_cache[1] != want_cache[1]).sum()),
    }


@pytest.mark.parametrize("batch,length", BATCH_LENGTHS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_and_cache_write_is_the_torch_ops_bit_for_bit(dtype, size, batch, length) -> None:
    assert rope_mismatches(kernels.rope_and_cache_write, size, dtype, batch, length) == {"q": 0, "keys": 0, "values": 0}


def ulps(value: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|value - exact| in units of `dtype`'s spacing at |exact| (its smallest normal's spacing below that)."""
    _, exponent = torch.frexp(exact.abs().clamp_min(torch.finfo(dtype).tiny))  # |exact| = m * 2**e, m in [0.5, 1)
    spacing = torch.finfo(dtype).eps * torch.pow(2.0, exponent.double() - 1)
    return (value.double() - exact).abs() / spacing


def rounding_slack(dtype: torch.dtype, dim: int) -> float:
    """How many ulps past the torch ops' worst error the kernel may land. Both round twice in `dtype`
    after an fp32 computation (normalise then weight; SiLU then the product), and before those the
    two fp32 values may differ by a few fp32 ulps (rsqrt and exp approximations, the order of the
    mean's reduction): each rounding can then land one step apart, 2 ulps. In fp32 those
    differences are themselves ulps of the result: a tree reduction's error grows with log2 of the
    terms, half of it passes through rsqrt."""
    return 2.0 + (math.log2(dim) / 2 if dtype == torch.float32 else 0.0)


def rms_norm_errors(call: Callable, size: str, dtype: torch.dtype, batch: int, length: int) -> tuple[float, float, float]:
    """(kernel's worst ulps against fp64, the torch ops' worst, the slack) for `call(x, weight, eps)`."""
    hidden = ar_config(size).hidden_size
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(batch, length, hidden, device="cuda", generator=generator) * 3).to(dtype)
    weight = (1 + torch.randn(hidden, device="cuda", generator=generator) / 4).to(dtype)
    x64 = x.double()
    exact = weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    kernel = ulps(call(x, weight, 1e-6), exact, dtype).max().item()
    torch_ops = ulps(kernels.rms_norm_torch(x, weight, 1e-6), exact, dtype).max().item()
    return kernel, torch_ops, rounding_slack(dtype, hidden)


def silu_errors(call: Callable, size: str, dtype: torch.dtype, batch: int, length: int) -> tuple[float, float, float]:
    """(kernel's worst ulps against fp64, the torch ops' worst, the slack) for `call(gate_up)`."""
    size_ = ar_config(size).intermediate_size
    generator = torch.Generator(device="cuda").manual_seed(2)
    gate_up = (torch.randn(batch, length, 2 * size_, device="cuda", generator=generator) * 4).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    kernel = ulps(call(gate_up), exact, dtype).max().item()
    torch_ops = ulps(kernels.silu_and_mul_torch(gate_up), exact, dtype).max().item()
    return kernel, torch_ops, rounding_slack(dtype, 1)


@pytest.mark.parametrize("batch,length", BATCH_LENGTHS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "errors,call", [(rms_norm_errors, kernels.rms_norm), (silu_errors, kernels.silu_and_mul)], ids=["rms_norm", "silu_and_mul"]
)
def test_norm_and_activation_round_as_the_torch_ops(errors, call, dtype, size, batch, length) -> None:
    kernel, torch_ops, slack = errors(call, size, dtype, batch, length)
    assert kernel <= torch_ops + slack, f"kernel {kernel:.2f} ulps vs the torch ops' {torch_ops:.2f} (+{slack:.1f} allowed)"


def test_the_checks_fail_on_broken_kernel_calls() -> None:
    """Swapped cos and sin, k and v written one slot late, an RMSNorm eps of 1e-2, gate and up swapped."""

    def swapped(qkv, cos, sin_signed, positions, keys, values, heads):
        return kernels.rope_and_cache_write(qkv, sin_signed, cos, positions, keys, values, heads)

    def one_slot_late(qkv, cos, sin_signed, positions, keys, values, heads):
        return kernels.rope_and_cache_write(qkv, cos, sin_signed, positions + 1, keys, values, heads)

    assert rope_mismatches(swapped, "tiny", torch.bfloat16, 3, 5)["q"] > 0
    late = rope_mismatches(one_slot_late, "tiny", torch.bfloat16, 3, 5)
    assert late["q"] == 0 and late["keys"] > 0 and late["values"] > 0
    kernel, torch_ops, slack = rms_norm_errors(lambda x, w, eps: kernels.rms_norm(x, w, 1e-2), "tiny", torch.float32, 3, 5)
    assert kernel > torch_ops + slack
    swap = lambda gate_up: kernels.silu_and_mul(torch.cat(gate_up.chunk(2, dim=-1)[::-1], dim=-1))
    kernel, torch_ops, slack = silu_errors(swap, "tiny", torch.bfloat16, 3, 5)
    assert kernel > torch_ops + slack


class FusedOpCounter(TorchDispatchMode):
    """Counts the calls of each `parity_serving::` op a forward dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("parity_serving."):
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("unfused", [False, True], ids=["fused", "unfused"])
def test_a_cuda_decode_step_runs_the_fused_kernels(unfused: bool) -> None:
    """What the decode graph captures: one RoPE-and-cache kernel per layer, every norm and every
    expert's activation fused; `unfused_kernels()` (the benchmark's baseline) runs none."""
    config = ar_config("tiny")
    adapter = ServingARAdapter.build(config, random_state_dict(config, 0, "cuda", torch.bfloat16), "cuda", torch.bfloat16)
    adapter.allocate_decode_state(2, 8)
    adapter.select_decode_graph("und_only")
    ids = torch.tensor([[3], [5]], device="cuda")
    positions = torch.tensor([0, 0], device="cuda")
    counter = FusedOpCounter()
    with adapter.unfused_kernels() if unfused else contextlib.nullcontext(), counter:
        adapter.decode_step(ids, positions)
    layers = config.num_hidden_layers
    expected = (
        {}
        if unfused
        else {
            "parity_serving.rope_and_cache_write": layers,
            "parity_serving.rms_norm": 2 * layers + 1,
            "parity_serving.silu_and_mul": layers,
        }
    )
    assert counter.calls == expected

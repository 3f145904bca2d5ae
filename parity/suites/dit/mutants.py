"""Mutants of the serving DiT: the sensitivity catalogue's DiT entries (`--target parity.suites.dit.mutants:<name>`).

Each factory takes no argument and returns the built-in serving target with ONE run-time change
applied to every DiT it loads or builds (an instance attribute, a bound method, or a class swap
of existing submodules to a subclass); the shipped code in `serving_models/` is never edited.
Each stands for a defect of vllm-project/vllm-omni#7455 or a port error the DiT suites must catch,
and names the suite and test that kill it (shown in `tests/suites/test_suites_dit.py`).

- `repeated_blocks_emptied`: `_repeated_blocks = []`, regional compile compiles nothing and runs
  eager. Killed by recompiles (regional row, warm-up counts) and by the compiled tests of numerics
  and image (regional row, `block_compiles`).
- `empty_text_skip_in_block`: the skip moved back into the block as `if sequence_length == 0`.
  Killed by recompiles (a new compile at the first text=0 point).
- `context_refiner_on_empty_text`: no empty-text skip at all. Killed by recompiles (same point).
- `rope_theta_from_llm`: the DiT RoPE built with the LLM's theta 1e6 instead of 10000. Killed by
  numerics (velocity and blocks vs reference) and image (serving vs reference).
- `compiled_rope_rotate_half`: a compile-only attention path with the rotate-half RoPE layout.
  Killed by numerics (compiled vs eager) and image (compiled vs eager); eager parity is intact.
- `sampler_cfg_range_per_step`: CFG decided per step instead of the release's latch. Killed by
  sampler (`cfg_trace` of the late-range loops) and image (the late-range case).
- `sampler_fp32_state`: fp32 latents between the steps of a bf16 model. Killed by sampler
  (`latents_dtype` and `mismatched_elements` of the bf16 loops).
- `sampler_drops_negative_prompt`: empty text where a negative prompt was given. Killed by
  sampler (`cfg_trace` of the negative-prompt loops) and image (the negative-prompt case).
- `schedule_torch_linspace`, `schedule_shift_from_height`: the schedule on torch.linspace's float32
  grid; the shift from the latent height alone. Killed by sampler (schedule `max_ulp`; the
  height-only shift at the non-square points only).
- `qk_norm_weights_swapped`, `adaln_bias_dropped`: a norm weight or a bias misapplied or dropped;
  visible because random checkpoints draw biases and norm weights. Killed by numerics.
- `key_padding_mask_dropped`: attention over padded text slots. Killed by the padded velocity case.
- `shift_from_width_only`, `cfg_range_end_exclusive`: sampler defects that cost about 40 dB (the
  time shift wrong on non-square latents; the step at CFG's range end unguided). Killed by image.
- `decoder_shift_factor_dropped`: the decoder without `+ shift_factor`. Killed by image.

docs/mutants.md lists every entry (generated from the catalogue).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

from parity.suites.sensitivity.catalogue import Kill, external
from serving_models.dit import adapter as dit_adapter
from serving_models.dit import model as dit_model
from serving_models.target import ServingTarget

Mutation = Callable[[Any], None]  # applied to a freshly loaded serving DiT adapter


class DiTMutantTarget(ServingTarget):
    """The serving target whose `load_dit` / `build_dit` return a DiT with `mutate` applied."""

    def __init__(self, name: str, mutate: Mutation) -> None:
        self.name = f"serving+{name}"
        self._mutate = mutate

    def load_dit(self, checkpoint_dir, device, dtype):
        adapter = super().load_dit(checkpoint_dir, device, dtype)
        self._mutate(adapter)
        return adapter

    def build_dit(self, config, state_dict, device, dtype):
        adapter = super().build_dit(config, state_dict, device, dtype)
        self._mutate(adapter)
        return adapter


# --- run-time changes ---------------------------------------------------------------------------


def _apply_refiners_without_skip(self, text, text_mask, text_rope, img, img_mask, img_rope, temb):
    """`_apply_refiners` with the empty-text skip removed: the context refiner sees length 0."""
    for layer in self.context_refiner:
        text = layer(text, text_mask, text_rope)
    for layer in self.noise_refiner:
        img = layer(img, img_mask, img_rope, temb)
    return text, img


class _BlockWithLengthSkip(dit_model.TransformerBlock):
    """The block with upstream's old short-circuit. The name stays `TransformerBlock`, so the
    regional compiler (which matches class names) compiles it and the counter counts it."""

    def forward(self, hidden_states, attention_mask, image_rotary_emb, temb=None):
        sequence_length = hidden_states.shape[1]
        if sequence_length == 0:  # a guard on a backed size: one more graph when 0 first arrives
            return hidden_states
        return super().forward(hidden_states, attention_mask, image_rotary_emb, temb)


_BlockWithLengthSkip.__name__ = _BlockWithLengthSkip.__qualname__ = "TransformerBlock"


def _rotate_half_layout(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs (i, i + D/2) (NeoX layout) with pair i's angle: wrong for this model,
    whose pairs are interleaved (2i, 2i+1) (docs/model.md §6)."""
    x = x.to(cos.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, :, None, 0::2], sin[:, :, None, 0::2]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


class _AttentionWithCompiledRotateHalf(dit_model.Attention):
    """Eager: the shipped attention. Under `torch.compile`: a "fused" path that applies RoPE in
    the rotate-half layout, as a compile-only kernel selection gone wrong would."""

    def forward(self, x, mask, rope):
        if not torch.compiler.is_compiling():
            return super().forward(x, mask, rope)
        dtype = x.dtype
        q = self.norm_q(self.to_q(x).unflatten(-1, (self.heads, self.head_dim)))
        k = self.norm_k(self.to_k(x).unflatten(-1, (self.kv_heads, self.head_dim)))
        v = self.to_v(x).unflatten(-1, (self.kv_heads, self.head_dim))
        q = _rotate_half_layout(q, *rope).to(dtype).transpose(1, 2)
        k = _rotate_half_layout(k, *rope).to(dtype).transpose(1, 2)
        v = v.transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=self.scale)
        out = out.transpose(1, 2).flatten(2)
        out = torch.where(mask[:, :, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        return self.to_out[0](out)


def _swap_class(module: torch.nn.Module, base: type, replacement: type) -> int:
    swapped = 0
    for sub in module.modules():
        if type(sub) is base:
            sub.__class__ = replacement
            swapped += 1
    if not swapped:
        raise RuntimeError(f"mutant: no {base.__name__} found in {type(module).__name__} to replace")
    return swapped


def _empty_repeated_blocks(adapter: Any) -> None:
    adapter.module._repeated_blocks = []


def _no_skip(adapter: Any) -> None:
    adapter.module._apply_refiners = types.MethodType(_apply_refiners_without_skip, adapter.module)


def _skip_in_block(adapter: Any) -> None:
    _no_skip(adapter)
    _swap_class(adapter.module, dit_model.TransformerBlock, _BlockWithLengthSkip)


LLM_ROPE_THETA = 1e6  # the Preview AR backbone's RoPE theta (docs/model.md §9); the DiT's is 10000


def _llm_theta(adapter: Any) -> None:
    adapter.module.rope_embedder.theta = LLM_ROPE_THETA


def _compiled_rotate_half(adapter: Any) -> None:
    _swap_class(adapter.module, dit_model.Attention, _AttentionWithCompiledRotateHalf)


def _swap_qk_norm_weights(adapter: Any) -> None:
    """Every attention's `norm_q` weight applied to keys and `norm_k`'s to queries (a loader that
    maps `attn.norm_q` <-> `attn.norm_k`, e.g. when renaming to `q_norm` / `k_norm`)."""
    attentions = [m for m in adapter.module.modules() if isinstance(m, dit_model.Attention)]
    if not attentions:
        raise RuntimeError("mutant: no Attention in the DiT")
    for attention in attentions:
        q, k = attention.norm_q.weight, attention.norm_k.weight
        attention.norm_q.weight, attention.norm_k.weight = k, q


def _drop_adaln_bias(adapter: Any) -> None:
    """The adaLN modulation linears (`norm1.linear`) run without their bias (a bias-less linear
    where the checkpoint has one)."""
    norms = [m for m in adapter.module.modules() if isinstance(m, dit_model.LuminaRMSNormZero)]
    if not norms:
        raise RuntimeError("mutant: no LuminaRMSNormZero in the DiT")
    for norm in norms:
        norm.linear.bias = None


class _AttentionWithoutKeyMask(dit_model.Attention):
    """Attention that attends to every key slot, padding included (a backend path that drops the
    key-padding mask); padded query rows are still zeroed as the shipped attention does."""

    def forward(self, x, mask, rope):
        out = super().forward(x, torch.ones_like(mask), rope)
        return torch.where(mask[:, :, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def _no_key_mask(adapter: Any) -> None:
    _swap_class(adapter.module, dit_model.Attention, _AttentionWithoutKeyMask)


def _decode_without_shift_factor(adapter: Any) -> None:
    """The latent decoder unscales with `latents / scaling_factor` and forgets `+ shift_factor`."""
    decoder = adapter.decoder
    shift = decoder.config.shift_factor
    forward = decoder.forward
    decoder.forward = lambda latents: forward(latents - shift * decoder.config.scaling_factor)


# --- the factories (`--target parity.suites.dit.mutants:<name>`) ----------------------------------------


def repeated_blocks_emptied() -> DiTMutantTarget:
    """`_repeated_blocks = []` (vllm-project/vllm-omni#7455 before the fix): nothing compiles; recompiles must fail."""
    return DiTMutantTarget("repeated_blocks_emptied", _empty_repeated_blocks)


def empty_text_skip_in_block() -> DiTMutantTarget:
    """The block-level `if sequence_length == 0` short-circuit instead of the refiner skip
    (vllm-project/vllm-omni#7455): CFG's zero-length stream compiles a new graph; recompiles must fail."""
    return DiTMutantTarget("empty_text_skip_in_block", _skip_in_block)


def context_refiner_on_empty_text() -> DiTMutantTarget:
    """No empty-text skip: the context refiner runs on 0 tokens and compiles for it; recompiles must fail."""
    return DiTMutantTarget("context_refiner_on_empty_text", _no_skip)


def rope_theta_from_llm() -> DiTMutantTarget:
    """The DiT's RoPE theta taken from the LLM config (1e6, not 10000); numerics must fail."""
    return DiTMutantTarget("rope_theta_from_llm", _llm_theta)


def compiled_rope_rotate_half() -> DiTMutantTarget:
    """A compile-only attention path with the rotate-half RoPE layout; numerics and image
    (compiled vs eager) must fail, eager parity is untouched."""
    return DiTMutantTarget("compiled_rope_rotate_half", _compiled_rotate_half)


def qk_norm_weights_swapped() -> DiTMutantTarget:
    """`norm_q` / `norm_k` weights swapped; numerics must fail (invisible with unit norm weights)."""
    return DiTMutantTarget("qk_norm_weights_swapped", _swap_qk_norm_weights)


def adaln_bias_dropped() -> DiTMutantTarget:
    """The adaLN modulation without its bias; numerics must fail (invisible with zero biases)."""
    return DiTMutantTarget("adaln_bias_dropped", _drop_adaln_bias)


def key_padding_mask_dropped() -> DiTMutantTarget:
    """Attention over padded text slots; the padded velocity case must fail."""
    return DiTMutantTarget("key_padding_mask_dropped", _no_key_mask)


def decoder_shift_factor_dropped() -> DiTMutantTarget:
    """The decoder without `+ shift_factor`; image (serving vs reference) must fail."""
    return DiTMutantTarget("decoder_shift_factor_dropped", _decode_without_shift_factor)


def shift_from_width_only() -> DiTMutantTarget:
    """The resolution-dependent time shift computed from the width twice (sqrt(w*w) for sqrt(h*w)):
    right on square latents, wrong on every non-square one; image must fail on the non-square case."""

    def width_only(schedule: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda steps, latent_height, latent_width: schedule(steps, latent_width, latent_width)

    return DiTMutantTarget(
        "shift_from_width_only",
        lambda adapter: _around(adapter, "flow_match_timesteps", width_only, ("sample", "timesteps")),
    )


def cfg_range_end_exclusive() -> DiTMutantTarget:
    """CFG's range read as half-open, `lo <= i/N < hi`: the step at the upper bound loses CFG;
    image must fail on the half-range case."""

    def half_open(scales: Callable[..., list[float]]) -> Callable[..., list[float]]:
        def exclusive(steps: int, guidance_scale: float, cfg_range: tuple[float, float]) -> list[float]:
            # The release's latch with the upper bound excluded: for a float x, `x <= nextafter(hi, -inf)` is `x < hi`.
            return scales(steps, guidance_scale, (cfg_range[0], math.nextafter(cfg_range[1], -math.inf)))

        return exclusive

    return DiTMutantTarget("cfg_range_end_exclusive", lambda adapter: _around(adapter, "guidance_per_step", half_open))


MUTANTS = {
    "repeated_blocks_emptied": repeated_blocks_emptied,
    "empty_text_skip_in_block": empty_text_skip_in_block,
    "context_refiner_on_empty_text": context_refiner_on_empty_text,
    "rope_theta_from_llm": rope_theta_from_llm,
    "compiled_rope_rotate_half": compiled_rope_rotate_half,
    "qk_norm_weights_swapped": qk_norm_weights_swapped,
    "adaln_bias_dropped": adaln_bias_dropped,
    "key_padding_mask_dropped": key_padding_mask_dropped,
    "decoder_shift_factor_dropped": decoder_shift_factor_dropped,
    "shift_from_width_only": shift_from_width_only,
    "cfg_range_end_exclusive": cfg_range_end_exclusive,
}


# ---------------------------------------------------------------------------------------------
# Catalogue entries: DiT regional compile (vllm-project/vllm-omni#7455) and DiT numerics
# ---------------------------------------------------------------------------------------------

external(
    "dit-repeated-blocks-emptied",
    defect="_repeated_blocks = []: regional compile compiles nothing and runs eager (vllm-project/vllm-omni#7455)",
    suite="recompiles",
    tests=("parity/suites/dit/test_recompiles.py",),
    target="parity.suites.dit.mutants:repeated_blocks_emptied",
)
external(
    "dit-empty-text-skip-in-block",
    defect="the empty-text skip as a block-level `if sequence_length == 0`: CFG's zero-length stream compiles a new graph",
    suite="recompiles",
    tests=("parity/suites/dit/test_recompiles.py",),
    target="parity.suites.dit.mutants:empty_text_skip_in_block",
)
external(
    "dit-context-refiner-on-empty-text",
    defect="no empty-text skip: the context refiner runs on 0 tokens and compiles for them",
    suite="recompiles",
    tests=("parity/suites/dit/test_recompiles.py",),
    target="parity.suites.dit.mutants:context_refiner_on_empty_text",
)
external(
    "dit-rope-theta-from-llm",
    defect="the DiT RoPE built with the LLM's theta (1e6) instead of 10000",
    suite="numerics",
    tests=("parity/suites/dit/test_numerics.py", "-k", "reference"),
    target="parity.suites.dit.mutants:rope_theta_from_llm",
    stage="rope",
)
external(
    "dit-compiled-rope-rotate-half",
    defect="a compile-only attention path applying RoPE in the rotate-half layout (eager untouched)",
    suite="numerics",
    tests=("parity/suites/dit/test_numerics.py", "-k", "compiled"),
    target="parity.suites.dit.mutants:compiled_rope_rotate_half",
    stage="context_refiner.0.q_rope",
    stage_note=(
        "compile-only: eager parity is intact, and its compiled attention rotates q and k without passing the rotary "
        "stage point, so q_rope/k_rope are not observed there and the compiled chain names the first attention output "
        "whose RoPE angles are not all zero (context_refiner.0.attn, or noise_refiner.0.attn for text of 0 or 1 tokens); "
        "the compile-only bisection names the piece, context_refiner.0.attn (compile_only_piece)"
    ),
)


# ---------------------------------------------------------------------------------------------
# The sampler: the release's loop and schedule (docs/model.md §8). Each change is scoped to the
# mutated adapter's calls: the named function of serving_models/dit/adapter.py is replaced while
# that adapter's `sample` (and `timesteps`) run.
# ---------------------------------------------------------------------------------------------


def _around(adapter: Any, attribute: str, change: Callable[[Any], Any], methods: tuple[str, ...] = ("sample",)) -> None:
    """`adapter.<method>` for each of `methods` runs with `serving_models.dit.adapter.<attribute>`
    replaced by `change(<the function there at that call>)`: a defect in how the adapter calls the
    function (or reads its result), so whatever observes that function (a stage map's `Call`) sees it."""
    for method in methods:
        original = getattr(adapter, method)

        def wrapped(*args: Any, _original: Callable = original, **kwargs: Any) -> Any:
            with mock.patch.object(dit_adapter, attribute, change(getattr(dit_adapter, attribute))):
                return _original(*args, **kwargs)

        setattr(adapter, method, wrapped)


def _while_running(adapter: Any, attribute: str, replacement: Any, methods: tuple[str, ...] = ("sample",)) -> None:
    """`adapter.<method>` for each of `methods` runs with `serving_models.dit.adapter.<attribute>` replaced."""
    _around(adapter, attribute, lambda _current: replacement, methods)


def _per_step_guidance(steps: int, guidance_scale: float, cfg_range: tuple[float, float]) -> list[float]:
    return [float(guidance_scale) if cfg_range[0] <= i / steps <= cfg_range[1] else 1.0 for i in range(steps)]


def _cfg_range_per_step(adapter: Any) -> None:
    _while_running(adapter, "guidance_per_step", _per_step_guidance)


class _ModelDtypeInputs(torch.nn.Module):
    """The model called with the latents cast to the model dtype, as a loop with fp32 state does."""

    def __init__(self, inner: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, latents, timestep, text_states, text_mask):
        return self.inner(latents.to(self.dtype), timestep, text_states, text_mask)


def _fp32_euler(x: torch.Tensor, v: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(x.dtype, torch.float32)
    return x.to(acc) + (t1 - t0).to(acc) * v.to(acc)


def _fp32_state(adapter: Any) -> None:
    original = adapter.sample

    def sample(*args: Any, **kwargs: Any) -> torch.Tensor:
        inner = adapter.module  # whatever module is current (the sampler suite swaps in a stand-in)
        adapter.module = _ModelDtypeInputs(inner, adapter.dtype)
        try:
            with mock.patch.object(dit_adapter, "euler_update", _fp32_euler):
                return original(*args, **kwargs)
        finally:
            adapter.module = inner

    adapter.sample = sample


def _drop_negative_prompt(adapter: Any) -> None:
    original = adapter.sample

    def sample(*args: Any, negative_states: Any = None, negative_mask: Any = None, **kwargs: Any) -> torch.Tensor:
        return original(*args, **kwargs)

    adapter.sample = sample


def _linspace_schedule(steps: int, latent_height: int, latent_width: int) -> torch.Tensor:
    t = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float32)[:-1]
    m = (latent_height * latent_width) ** 0.5 / 40.0
    return torch.cat([t / (m - m * t + t), torch.ones(1)])


def _height_only_schedule(steps: int, latent_height: int, latent_width: int) -> torch.Tensor:
    return _shipped_schedule(steps, latent_height, latent_height)


_shipped_schedule = dit_adapter.flow_match_timesteps


def _schedule_torch_linspace(adapter: Any) -> None:
    _while_running(adapter, "flow_match_timesteps", _linspace_schedule, ("sample", "timesteps"))


def _schedule_shift_from_height(adapter: Any) -> None:
    _while_running(adapter, "flow_match_timesteps", _height_only_schedule, ("sample", "timesteps"))


def sampler_cfg_range_per_step() -> DiTMutantTarget:
    """CFG decided per step from i/N, not the release's latch; sampler and image must fail."""
    return DiTMutantTarget("sampler_cfg_range_per_step", _cfg_range_per_step)


def sampler_fp32_state() -> DiTMutantTarget:
    """fp32 latents between the steps of a half-precision model; the sampler's bf16 loops must fail."""
    return DiTMutantTarget("sampler_fp32_state", _fp32_state)


def sampler_drops_negative_prompt() -> DiTMutantTarget:
    """The negative prompt ignored (empty text unconditional); sampler and image must fail."""
    return DiTMutantTarget("sampler_drops_negative_prompt", _drop_negative_prompt)


def schedule_torch_linspace() -> DiTMutantTarget:
    """The schedule on torch.linspace's float32 grid (1-4 ULP off); the schedule rows must fail."""
    return DiTMutantTarget("schedule_torch_linspace", _schedule_torch_linspace)


def schedule_shift_from_height() -> DiTMutantTarget:
    """The shift from the latent height alone; the non-square schedule rows must fail."""
    return DiTMutantTarget("schedule_shift_from_height", _schedule_shift_from_height)


MUTANTS.update(
    {
        "sampler_cfg_range_per_step": sampler_cfg_range_per_step,
        "sampler_fp32_state": sampler_fp32_state,
        "sampler_drops_negative_prompt": sampler_drops_negative_prompt,
        "schedule_torch_linspace": schedule_torch_linspace,
        "schedule_shift_from_height": schedule_shift_from_height,
    }
)

SAMPLER = "parity/suites/dit/test_sampler.py"

external(
    "dit-cfg-range-per-step",
    defect="CFG decided per step from i/N instead of the release's latch (off for good at the first step outside cfg_range)",
    suite="sampler",
    tests=(SAMPLER, "-k", "loop"),
    target="parity.suites.dit.mutants:sampler_cfg_range_per_step",
)
external(
    "dit-fp32-state-between-steps",
    defect="the latents kept in fp32 between the Euler steps of a bf16 model (the release keeps the model dtype)",
    suite="sampler",
    tests=(SAMPLER, "-k", "loop and bf16"),
    target="parity.suites.dit.mutants:sampler_fp32_state",
)
external(
    "dit-negative-prompt-dropped",
    defect="the negative prompt ignored: the unconditional branch runs empty text",
    suite="sampler",
    tests=(SAMPLER, "-k", "loop"),
    target="parity.suites.dit.mutants:sampler_drops_negative_prompt",
)
external(
    "dit-schedule-torch-linspace",
    defect="the flow-match schedule on torch.linspace's float32 grid instead of numpy's (1-4 ULP on many times)",
    suite="sampler",
    tests=(SAMPLER, "-k", "schedule"),
    target="parity.suites.dit.mutants:schedule_torch_linspace",
)
external(
    "dit-schedule-shift-from-height",
    defect="the time shift from the latent height alone (right on square latents only)",
    suite="sampler",
    tests=(SAMPLER, "-k", "schedule"),
    target="parity.suites.dit.mutants:schedule_shift_from_height",
)

# DiT weights (visible since random checkpoints draw biases and norm weights), attention masking,
# the sampler's schedule and CFG range, the decoder

DIT_NUMERICS_EAGER = ("parity/suites/dit/test_numerics.py", "-k", "reference")
# The empty-text cases run no context refiner (the serving empty-text skip), so a defect in every
# attention shows first in the noise refiner there: left out where the stage named is the context
# refiner's (the catalogue's `stage` holds for every case a mutant's selection localises).
DIT_NUMERICS_EAGER_WITH_TEXT = ("parity/suites/dit/test_numerics.py", "-k", "reference and not text0")
SERVING_IMAGES = ("parity/suites/dit/test_image.py", "-k", "serving_images")
IMAGES_IN_FP32 = Kill(
    SERVING_IMAGES,
    dtype="fp32",
    why=(
        "a bf16 image is about 49 dB from the fp64 golden, so the bf16 bound is about 39-40 dB and a defect that "
        "costs 40 dB from 90 dB (52-54 dB) or lands at 41 dB is inside it: equivalent at bf16; fp32 (TF32 off) "
        "bounds at 80-83 dB"
    ),
)

external(
    "dit-qk-norm-weights-swapped",
    defect="the loader maps attn.norm_q <-> attn.norm_k: queries get the key norm's weight and back; every tensor is read, and with unit norm weights the outputs were identical",
    suite="numerics",
    tests=DIT_NUMERICS_EAGER_WITH_TEXT,
    target="parity.suites.dit.mutants:qk_norm_weights_swapped",
    stage="context_refiner.0.q_norm",
)
external(
    "dit-adaln-bias-dropped",
    defect="the adaLN modulation linears (norm1.linear) built without bias where the checkpoint has one (vllm-project/vllm-omni#7221 moved these linears to vLLM layers); invisible with zero biases",
    suite="numerics",
    tests=DIT_NUMERICS_EAGER,
    target="parity.suites.dit.mutants:adaln_bias_dropped",
    stage="noise_refiner.0.adaln",
)
external(
    "dit-key-padding-mask-dropped",
    defect="attention attends to padded text slots (a backend path that drops the key-padding mask): only batches whose texts differ in length change",
    suite="numerics",
    tests=("parity/suites/dit/test_numerics.py", "-k", "velocity and padded"),
    target="parity.suites.dit.mutants:key_padding_mask_dropped",
    stage="context_refiner.0.attn",
    cuda=Kill(
        ("parity/suites/dit/test_numerics.py", "-k", "velocity and padded"),
        dtype="fp32",
        why=(
            "the padded velocity moves by RMSE 1.2e-2 (tiny), inside bf16's bound there (3x the bf16 reference's "
            "7.5e-3): equivalent at bf16, so the CUDA lane checks it in fp32"
        ),
    ),
)
external(
    "dit-shift-from-width-only",
    defect="the sampler's resolution-dependent time shift from sqrt(w*w) instead of sqrt(h*w): exact on square latents, a schedule 40 dB off on non-square ones (images at 52-54 dB passed the former fixed 40 dB bound)",
    suite="image",
    tests=SERVING_IMAGES,
    target="parity.suites.dit.mutants:shift_from_width_only",
    cuda=IMAGES_IN_FP32,
    stage="timesteps",
)
external(
    "dit-cfg-range-end-exclusive",
    defect="CFG's cfg_range read as half-open (i/N < hi): the step at the upper bound runs without guidance (images at 52-53 dB passed the former fixed 40 dB bound)",
    suite="image",
    tests=SERVING_IMAGES,
    target="parity.suites.dit.mutants:cfg_range_end_exclusive",
    cuda=IMAGES_IN_FP32,
    stage="guidance",
)
external(
    "dit-decoder-shift-factor-dropped",
    defect="the latent decoder unscales with latents / scaling_factor and drops + shift_factor (the FLUX VAE's shift, a classic omission of ports)",
    suite="image",
    tests=SERVING_IMAGES,
    target="parity.suites.dit.mutants:decoder_shift_factor_dropped",
    cuda=IMAGES_IN_FP32,
    stage="decoded",
)

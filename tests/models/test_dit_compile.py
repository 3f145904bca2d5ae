"""Regional compile of the serving DiT: compile counts over a shape lattice, and its mutants.

What the `recompiles` suite will do, checked here on the CPU: every submodule whose class name
is in `model._repeated_blocks` gets `forward = torch.compile(forward, fullgraph=True,
dynamic=True)`; compilations of the block's `forward` code object are counted by wrapping
`torch._dynamo.convert_frame._compile` (library frames compile on their own, so an all-frames
counter would pass with regional compile switched off: vllm-project/vllm-omni#7455).

Expected counts (docs/model.md §7) and what was measured:
* warm-up (32x32 latents, 4 text tokens, CFG on): 2 = one per block kind (the `norm1` type
  guard: RMSNorm in the context refiner, LuminaRMSNormZero elsewhere);
* then none across 32x32, 32x64, 64x32, 48x48 latents x text lengths {0, 4, 77} x CFG on/off;
* text length 1 adds exactly one: the context refiner then sees a size-1 sequence dim, which
  Dynamo specialises even with dynamic=True (the 0/1 rule; guard `2 <= hidden_states.size()[1]`
  on the first graph). No other block call has a size-1 dynamic dim: the batch is always 1
  (static, specialised at warm-up) and image sequences are >= 256 tokens.

The count is decided by Dynamo's guards, so the lattice runs with the `eager` backend to stay
fast; the `slow` test repeats the warm-up with Inductor and checks compiled vs eager numerics.
Measured on the shared 2-core helper box (torch 2.13 CPU): the same counts with Inductor over
the whole lattice; Inductor warm-up (both kinds) 23-48 s with a cold cache, 5-9 s warm; the
text-length-1 compile 5 s cold; the eager-backend tests here take 1-6 s each.
"""

from __future__ import annotations

import time
import types

import pytest
import torch
import torch._dynamo
from torch._dynamo import convert_frame

from serving_models.dit import model as dit_model
from serving_models.dit.model import TransformerBlock
from tests.support.dit_support import latents, tiny_pair

pytestmark = pytest.mark.parity_slow  # module fixtures compile: seconds


SIZES = [(32, 32), (32, 64), (64, 32), (48, 48)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Tests compiling the same code object share Dynamo's cache (vllm-project/vllm-omni#7455): reset both ways.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class BlockCompileCounter:
    """Counts Dynamo compilations of the compiled blocks' `forward` code objects only."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.codes: set = set()
        self.count = 0
        original = convert_frame._compile

        def counting(code, *args, **kwargs):
            if code in self.codes:
                self.count += 1
            return original(code, *args, **kwargs)

        monkeypatch.setattr(convert_frame, "_compile", counting)


@pytest.fixture
def counter(monkeypatch):
    return BlockCompileCounter(monkeypatch)


def regionally_compile(model: torch.nn.Module, counter: BlockCompileCounter, backend: str) -> int:
    """Compile every `_repeated_blocks` submodule's forward in place; return how many."""
    names = set(getattr(model, "_repeated_blocks", []))
    compiled = 0
    for module in model.modules():
        if type(module).__name__ in names:
            counter.codes.add(type(module).forward.__code__)
            module.forward = torch.compile(module.forward, fullgraph=True, dynamic=True, backend=backend)
            compiled += 1
    return compiled


def step(serving, size, text_len, cfg: bool) -> None:
    """One sampler step: CFG on = the conditional and the zero-text unconditional batch-1 call."""
    text, mask = serving.text_condition(text_len, seed=text_len)
    serving.sample(text, mask, *size, steps=1, guidance_scale=4.0 if cfg else 1.0, seed=0)


@pytest.fixture(scope="module")
def lattice_counts() -> dict[str, int]:
    """Block compiles after each stage of one regionally compiled serving DiT (eager backend) from an
    empty Dynamo cache: the warm-up, the lattice, then text length 1 at 32x32 and at the other sizes.
    The lattice test and the text-length-1 test read the same run: its warm-up compile is most of
    either test's time, and text length 1 comes after the lattice, so the lattice sees only the
    warm-up's graphs."""
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as monkeypatch:
        counter = BlockCompileCounter(monkeypatch)
        _, serving = tiny_pair()
        counts = {"blocks": regionally_compile(serving.module, counter, "eager")}
        step(serving, (32, 32), 4, cfg=True)
        counts["warm-up"] = counter.count
        for size in SIZES:
            for text_len in (0, 4, 77):
                step(serving, size, text_len, cfg=True)
        step(serving, (48, 48), 77, cfg=False)
        counts["lattice"] = counter.count
        step(serving, (32, 32), 1, cfg=True)
        counts["text length 1"] = counter.count
        for size in SIZES[1:]:
            step(serving, size, 1, cfg=True)
            step(serving, size, 4, cfg=True)
        counts["other sizes at text lengths 1 and 4"] = counter.count
    torch._dynamo.reset()
    return counts


def test_no_recompile_across_resolutions_text_lengths_and_cfg(lattice_counts: dict[str, int]) -> None:
    assert lattice_counts["blocks"] == 4
    assert lattice_counts["warm-up"] == 2, "warm-up: one compile per block kind (RMSNorm vs LuminaRMSNormZero norm1)"
    assert lattice_counts["lattice"] == 2, "a resolution, text length or CFG branch recompiled a block"


def test_text_length_one_specialises_the_context_refiner_once(lattice_counts: dict[str, int]) -> None:
    """Observed, not engineered around: the 0/1 rule costs one more compile at text length 1."""
    assert lattice_counts["warm-up"] == 2
    assert lattice_counts["text length 1"] == 3
    assert lattice_counts["other sizes at text lengths 1 and 4"] == 3


def test_view_inputs_would_compile_a_third_graph(counter, monkeypatch):
    """Why `block_input` exists: without it the warm-up compiles 3 graphs, not 2 (the noise
    refiner's input is a view of x_embedder's matmul output, the main stack's a cat result)."""
    monkeypatch.setattr(dit_model, "block_input", lambda t: t)
    _, serving = tiny_pair()
    regionally_compile(serving.module, counter, "eager")
    step(serving, (32, 32), 4, cfg=True)
    assert counter.count == 3


def test_catches_missing_repeated_blocks(counter, monkeypatch):
    """Mutant: no `_repeated_blocks` -> regional compile compiles nothing (runs eager)."""
    _, serving = tiny_pair()
    monkeypatch.setattr(type(serving.module), "_repeated_blocks", [])
    assert regionally_compile(serving.module, counter, "eager") == 0
    step(serving, (32, 32), 4, cfg=True)
    assert counter.count == 0  # the suite's "expected 2 compiles" turns red


def _apply_refiners_without_skip(self, text, text_mask, text_rope, img, img_mask, img_rope, temb):
    for layer in self.context_refiner:
        text = layer(text, text_mask, text_rope)
    for layer in self.noise_refiner:
        img = layer(img, img_mask, img_rope, temb)
    return text, img


def test_catches_the_context_refiner_run_on_empty_text(counter):
    """Mutant: no empty-text skip -> CFG's zero-token stream compiles another graph."""
    _, serving = tiny_pair()
    serving.module._apply_refiners = types.MethodType(_apply_refiners_without_skip, serving.module)
    regionally_compile(serving.module, counter, "eager")
    step(serving, (32, 32), 4, cfg=False)
    assert counter.count == 2
    step(serving, (32, 32), 4, cfg=True)
    assert counter.count == 3


def test_catches_the_skip_moved_back_into_the_block(counter, monkeypatch):
    """Mutant (vllm-project/vllm-omni#7455): `if sequence_length == 0` inside the block guards on a backed
    size, so the first zero-token stream compiles a second graph of the block."""
    original = TransformerBlock.forward

    def forward_with_block_skip(self, hidden_states, attention_mask, image_rotary_emb, temb=None):
        if hidden_states.shape[1] == 0:
            return hidden_states
        return original(self, hidden_states, attention_mask, image_rotary_emb, temb)

    monkeypatch.setattr(TransformerBlock, "forward", forward_with_block_skip)
    _, serving = tiny_pair()
    serving.module._apply_refiners = types.MethodType(_apply_refiners_without_skip, serving.module)
    regionally_compile(serving.module, counter, "eager")
    step(serving, (32, 32), 4, cfg=False)
    assert counter.count == 2
    step(serving, (32, 32), 4, cfg=True)
    assert counter.count == 3


def test_fullgraph_rejects_a_host_read_inside_a_block(counter, monkeypatch):
    """Mutant: a `torch.any(~mask)` host branch in attention is a graph break -> error."""
    original = dit_model.Attention.forward

    def forward_with_host_branch(self, x, mask, rope):
        if torch.any(~mask):
            x = x * 1.0
        return original(self, x, mask, rope)

    monkeypatch.setattr(dit_model.Attention, "forward", forward_with_host_branch)
    _, serving = tiny_pair()
    regionally_compile(serving.module, counter, "eager")
    # The message differs across torch versions ("Data-dependent branching" in 2.13).
    with pytest.raises(torch._dynamo.exc.TorchDynamoException, match="(?i)data-dependent|control flow"):
        step(serving, (32, 32), 4, cfg=False)


def test_inductor_compiled_matches_eager(counter):
    """Inductor on CPU: warm-up compile count and compiled vs eager velocity.

    fp32 atol = rtol = 1e-5: Inductor fuses multiply-adds and reorders reductions.
    """
    _, eager = tiny_pair()
    _, compiled = tiny_pair()
    regionally_compile(compiled.module, counter, "inductor")
    x, t = latents((1, 16, 32, 32)), torch.tensor([0.45])
    start = time.perf_counter()
    for text_len in (4, 0, 77):
        text, mask = compiled.text_condition(text_len, seed=text_len)
        torch.testing.assert_close(compiled.forward(x, t, text, mask), eager.forward(x, t, text, mask), atol=1e-5, rtol=1e-5)
    print(f"inductor warm-up and three forwards: {time.perf_counter() - start:.1f} s")
    assert counter.count == 2

"""The reference against something nobody here wrote, and its upstream routing semantics."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from reference_models.ar import model as ref
from reference_models.ar.model import MammothModa2ForCausalLM
from reference_models.checkpoints import random_state_dict
from tests.support.ar_support import GEN_LAST, START, TINY, mixed_ids


def qwen2_pair(seed: int = 7) -> tuple[MammothModa2ForCausalLM, Qwen2ForCausalLM]:
    """The reference with gen vocabulary and experts disabled, and transformers' Qwen2 on the same weights."""
    config = TINY.replace(extra_gen_vocab=False, moe_type="none")
    state = random_state_dict(config, seed)
    ours = MammothModa2ForCausalLM.from_state_dict(config, state)
    hf_config = Qwen2Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=False,
        attn_implementation="eager",  # upstream's eager attention path
    )
    theirs = Qwen2ForCausalLM(hf_config).eval()
    # strict=True: our tensor names are exactly the Qwen2 checkpoint names.
    theirs.load_state_dict(state, strict=True)
    return ours, theirs


@torch.no_grad()
def test_reference_equals_transformers_qwen2() -> None:
    ours, theirs = qwen2_pair()
    ids = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    mine = ours(input_ids=ids)
    hf = theirs(input_ids=ids, output_hidden_states=True)
    # fp32 noise: assert_close's fp32 defaults (rtol 1.3e-6, atol 1e-5); both run eager attention
    # with the same op order, so on one machine the difference is usually exactly zero.
    torch.testing.assert_close(mine.logits, hf.logits)
    # HF's hidden_states: embeddings, outputs of layers 0..n-2, then the final *normed* state.
    for ours_layer, hf_layer in zip(mine.hidden_states[:-1], hf.hidden_states[1:-1], strict=True):
        torch.testing.assert_close(ours_layer, hf_layer)
    torch.testing.assert_close(mine.last_hidden_state, hf.hidden_states[-1])


@torch.no_grad()
def test_transformers_check_catches_a_changed_eps() -> None:
    ours, theirs = qwen2_pair()
    for module in ours.modules():
        if isinstance(module, ref.Qwen2RMSNorm):
            module.variance_epsilon = 1e-2  # the "RMSNorm eps changed" mutant
    ids = torch.randint(0, TINY.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


@torch.no_grad()
def test_vocabulary_boundaries(reference) -> None:
    model = reference.module.model
    ids = torch.tensor([[START - 1, START, GEN_LAST]])
    assert ref.derive_gen_token_mask(ids, START).tolist() == [[False, True, True]]
    emb = reference.embed(ids)[0]
    assert torch.equal(emb[0], model.embed_tokens.weight[START - 1])
    assert torch.equal(emb[1], model.gen_embed_tokens.weight[0])
    assert torch.equal(emb[2], model.gen_embed_tokens.weight[TINY.gen_vocab_size - 1])

    out = reference.module(input_ids=ids)
    h = out.last_hidden_state[0]
    logits = out.logits[0]
    assert logits.shape[-1] == TINY.vocab_size + TINY.gen_vocab_size
    # column vocab_size + j is token start + j
    torch.testing.assert_close(logits[:, TINY.vocab_size + 5], h @ reference.module.gen_head.weight[5])
    torch.testing.assert_close(logits[:, START - 1], h @ reference.module.lm_head.weight[START - 1])


def test_moe_forward_equals_a_per_row_select() -> None:
    torch.manual_seed(0)
    und, gen = ref.Qwen2MLP(TINY), ref.Qwen2MLP(TINY)
    x = torch.randn(2, 7, TINY.hidden_size)
    mask = torch.rand(2, 7) > 0.5
    with torch.no_grad():
        routed = ref.moe_forward(x, und, gen, mask)
        select = torch.where(mask[..., None], gen(x), und(x))
        # GEMMs on row subsets vs all rows: equal up to GEMM-shape rounding (docs/model.md §4).
        torch.testing.assert_close(routed, select)
        assert torch.equal(ref.moe_forward(x, und, gen, torch.zeros_like(mask)), und(x))
        assert torch.equal(ref.moe_forward(x, und, gen, torch.ones_like(mask)), gen(x))
        assert torch.equal(ref.moe_forward(x, und, gen, None), und(x))
        assert torch.equal(ref.moe_forward(x, und, None, mask), und(x))


@torch.no_grad()
def test_embeddings_without_mask_take_the_und_expert_everywhere(reference) -> None:
    """Upstream's hazard, kept on purpose: inputs_embeds and no mask -> mask None -> mlp only."""
    ids = mixed_ids()
    embeds = reference.embed(ids)
    hazard = reference.forward(inputs_embeds=embeds)
    routed = reference.forward(inputs_embeds=embeds, gen_token_mask=ids >= START)
    all_und = reference.forward(inputs_embeds=embeds, gen_token_mask=torch.zeros_like(ids, dtype=torch.bool))
    assert torch.equal(hazard.logits, all_und.logits)
    assert not torch.allclose(hazard.logits, routed.logits)
    # the outer-model entry derives the mask from the ids: same as the plain id path
    assert torch.equal(reference.forward_multimodal(embeds, ids).logits, reference.forward(ids).logits)


@torch.no_grad()
def test_greedy_rederives_the_mask_every_step(reference) -> None:
    prompt = torch.tensor([[3, 17, 42, 262]])
    tokens, step_logits = reference.module.greedy_generate(prompt, 5)
    sequence = torch.cat([prompt, tokens], dim=1)
    for i in range(tokens.shape[1]):
        prefix = sequence[:, : prompt.shape[1] + i]
        assert torch.equal(step_logits[:, i], reference.module(input_ids=prefix).logits[:, -1])
    assert torch.equal(tokens, step_logits.argmax(-1))


def test_attention_experts_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="attention experts"):
        MammothModa2ForCausalLM(TINY.replace(moe_type="ffn_attention-2:4"))


def test_rmsnorm_computes_in_the_promoted_dtype() -> None:
    norm = ref.Qwen2RMSNorm(8, eps=1e-6).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(norm(x), want)  # fp64 stays fp64 (an fp32 round trip would differ)
    assert not torch.equal(norm(x), (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).double())

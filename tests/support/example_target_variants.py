"""Broken variants of the example engine target (examples/engine_target), as `--parity-target` factories."""

from __future__ import annotations

from typing import Any


def make_target_mask_past_start() -> Any:
    """The porter's planted bug: the gen mask as `id > start`, so the first gen id takes the und expert."""
    from examples.engine_target import engine, parity_target

    engine.derive_gen_token_mask = lambda input_ids, start: input_ids > start
    return parity_target.make_target()


def make_target_rope_theta_default() -> Any:
    """A porter's planted bug: every attention built with RoPE theta 10000, not the config's."""
    from examples.engine_target import engine, parity_target

    original = engine.Attention.__init__

    def __init__(self, config) -> None:
        original(self, config)
        self.theta = 10000.0

    engine.Attention.__init__ = __init__
    return parity_target.make_target()


def make_target_kv_slot_late() -> Any:
    """A porter's planted bug: a decode step writes its key and value one cache slot late (the
    slot its query reads stays empty, the next step's is overwritten)."""
    import torch
    import torch.nn.functional as F

    from examples.engine_target import engine, parity_target

    original = engine.Attention.forward

    def forward(self, positions, x, kv_cache):
        if kv_cache is None or positions.shape[1] != 1:
            return original(self, positions, x, kv_cache)
        batch, length, _ = x.shape
        q, k, v = self.qkv_proj(x).split(list(self.qkv_proj.shards.values()), dim=-1)
        cos, sin = engine.rotary(positions, self.head_dim, self.theta, x.dtype)
        q = engine.rotate(q.view(batch, length, self.heads, self.head_dim), cos[:, :, None], sin[:, :, None]).transpose(1, 2)
        k = engine.rotate(k.view(batch, length, self.kv_heads, self.head_dim), cos[:, :, None], sin[:, :, None]).transpose(1, 2)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        late = (positions + 1).clamp(max=kv_cache.shape[3] - 1)
        index = late[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
        kv_cache[0].scatter_(2, index, k)
        kv_cache[1].scatter_(2, index, v)
        keys = torch.arange(kv_cache.shape[3], device=x.device)
        visible = keys[None, None, None, :] <= positions[:, None, :, None]
        out = F.scaled_dot_product_attention(q, kv_cache[0], kv_cache[1], attn_mask=visible, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    engine.Attention.forward = forward
    return parity_target.make_target()


def make_target_without_greedy_generate() -> Any:
    """A target whose AR adapter lacks a member of the contract (for `parity check-target`)."""
    from examples.engine_target import parity_target

    class Incomplete(parity_target.EngineARAdapter):
        def __getattribute__(self, name: str) -> Any:
            if name == "greedy_generate":
                raise AttributeError(name)
            return super().__getattribute__(name)

    class Target(parity_target.EngineTarget):
        def load_ar(self, checkpoint_dir, device, dtype):
            adapter = super().load_ar(checkpoint_dir, device, dtype)
            adapter.__class__ = Incomplete
            return adapter

    return Target()


def make_target_decorated_methods() -> Any:
    """The example's adapter with its entry points decorated the ordinary way an engine writes an
    inference method: `forward` (the recompiles suite's) under `@torch.no_grad()`, `embed`
    (embedding_clamp's one compiled frame) under `@torch.inference_mode()`. Both decorators live in
    a file Dynamo skips; the compile counts must still be those of the undecorated example."""
    import torch

    from examples.engine_target import parity_target

    adapter = parity_target.EngineARAdapter
    adapter.forward = torch.no_grad()(adapter.forward)  # type: ignore[method-assign]
    adapter.embed = torch.inference_mode()(adapter.embed)  # type: ignore[method-assign]
    return parity_target.make_target()


def make_target_gen_column_as_token() -> Any:
    """A porter's slip: greedy decoding hands back the argmax logits column as the token id (right
    only while the gen start is the text table's size, docs/checkpoints.md §4)."""
    from examples.engine_target import parity_target

    parity_target.EngineARAdapter.token_of_column = lambda self, column: column  # type: ignore[method-assign]
    return parity_target.make_target()

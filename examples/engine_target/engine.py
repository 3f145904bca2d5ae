"""A MammothModa2 AR backbone written the way a serving engine writes its models (vLLM style).

This is the *engine's* code, not the harness's: it imports nothing from parity, serving_models or
reference_models. What makes it engine-like, and different from the built-in serving model:

- the engine's own forward signature, `forward(input_ids, positions, kv_caches, inputs_embeds,
  gen_token_mask) -> hidden_states`, and a separate `compute_logits(hidden_states)`;
- fused-residual layers: `RMSNorm(x, residual) -> (normed, x + residual)` and decoder layers that
  return `(moe_out, residual)`, leaving the residual add to the next layer's norm;
- fused `qkv_proj` and `gate_up_proj`, filled by the engine's own weight loader
  (`load_weights(iterable of (name, tensor))`, vLLM's stacked-parameter mapping), which reads the
  parity layout and the release layout's prefixed names;
- one MoE strategy in every mode: the graph-safe blend `where(mask, gen(x), und(x))` (no eager
  fast path), capture without a mask refused with the engine's own wording;
- per-layer KV caches `[2, B, kv_heads, max_len, head_dim]` written in place at `positions`.

The parity adapter over it is `examples/engine_target/parity_target.py`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

# ----------------------------------------------------------------------------------------------
# The engine's capture probes (one per device type; a missing one warns once)
# ----------------------------------------------------------------------------------------------


class CaptureProbes:
    """Is the current stream being captured into a graph? The engine asks before choosing a path."""

    def __init__(self) -> None:
        self._probes: dict[str, Callable[[], bool]] = {
            "cuda": torch.cuda.is_current_stream_capturing,
            "cpu": lambda: False,
        }
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def register_capture_probe(self, backend: str, probe: Callable[[], bool] | None) -> Callable[[], bool] | None:
        with self._lock:
            previous = self._probes.get(backend)
            if probe is None:
                self._probes.pop(backend, None)
            else:
                self._probes[backend] = probe
            return previous

    @contextlib.contextmanager
    def capture_probe(self, backend: str, probe: Callable[[], bool] | None) -> Iterator[None]:
        previous = self.register_capture_probe(backend, probe)
        try:
            yield
        finally:
            self.register_capture_probe(backend, previous)

    def is_capturing(self, device: torch.device | str) -> bool:
        backend = torch.device(device).type
        probe = self._probes.get(backend)
        if probe is None:
            with self._lock:
                first = backend not in self._warned
                self._warned.add(backend)
            if first:
                warnings.warn(f"engine: no capture probe for {backend!r}; assuming eager", RuntimeWarning, stacklevel=2)
            return False
        return bool(probe())


PROBES = CaptureProbes()

# ----------------------------------------------------------------------------------------------
# Config: the engine reads config.json itself (flat, or the release's nested llm_config.text_config)
# ----------------------------------------------------------------------------------------------

# Upstream's text-config defaults (Qwen2.5-VL style) for keys a config.json leaves out.
DEFAULTS = {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5, "gen_vocab_size": 32800, "moe_type": "ffn"}


@dataclass(frozen=True)
class EngineConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float
    rms_norm_eps: float
    gen_vocab_size: int
    gen_vocab_start_index: int
    moe_type: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def moe_layers(self) -> range:
        kind, _, layers = self.moe_type.partition("-")
        if "ffn" not in kind:
            return range(0)
        if not layers:
            return range(self.num_hidden_layers)
        start, end = (int(v) for v in layers.split(":"))
        return range(start, min(end, self.num_hidden_layers))

    @classmethod
    def from_hf(cls, source: Mapping | object) -> EngineConfig:
        """From a config.json dict (flat or release-nested) or any object with the upstream names."""
        if not isinstance(source, Mapping):
            source = {name: getattr(source, name) for name in cls.__dataclass_fields__ if hasattr(source, name)}
        elif "llm_config" in source:  # the release: Mammothmoda2Config -> llm_config -> text_config
            llm = source["llm_config"]
            source = {**{k: llm[k] for k in ("gen_vocab_size", "gen_vocab_start_index", "moe_type") if k in llm}}
            source.update(llm.get("text_config", {}))
        values = {**DEFAULTS, **{k: v for k, v in source.items() if k in cls.__dataclass_fields__}}
        values.setdefault("gen_vocab_start_index", values["vocab_size"])
        return cls(**values)


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm with the residual add fused in: `norm(x)` or `norm(x, residual) -> (normed, x + residual)`."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


class MergedLinear(nn.Linear):
    """Several checkpoint projections stacked along the output dim (`shards`: name -> rows)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = shards


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate|up fused into one GEMM."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        width = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate_proj": width, "up_proj": width}, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[B, L, head_dim]` of rotate-half RoPE at `positions` `[B, L]`."""
    compute = torch.promote_types(dtype, torch.float32)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).to(compute)
    freqs = positions[..., None].to(compute) * (1.0 / theta ** (exponent / head_dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.theta = config.rope_theta
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}, bias=True)
        self.o_proj = nn.Linear(q, config.hidden_size, bias=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor | None) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv_proj(x).split(list(self.qkv_proj.shards.values()), dim=-1)
        q = q.view(batch, length, self.heads, self.head_dim)
        k = k.view(batch, length, self.kv_heads, self.head_dim)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary(positions, self.head_dim, self.theta, x.dtype)
        q = rotate(q, cos[:, :, None], sin[:, :, None]).transpose(1, 2)
        k = rotate(k, cos[:, :, None], sin[:, :, None]).transpose(1, 2)
        if kv_cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # write at `positions`, attend over the whole static cache up to each query's position
            index = positions[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
            kv_cache[0].scatter_(2, index, k)
            kv_cache[1].scatter_(2, index, v)
            keys = torch.arange(kv_cache.shape[3], device=x.device)
            visible = keys[None, None, None, :] <= positions[:, None, :, None]
            out = F.scaled_dot_product_attention(q, kv_cache[0], kv_cache[1], attn_mask=visible, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


def refuse_capture_without_mask(layer: int) -> RuntimeError:
    return RuntimeError(
        f"engine: layer {layer} cannot route MoE tokens while a graph is captured without a generation-token "
        "mask; run this request eagerly"
    )


class DecoderLayer(nn.Module):
    """vLLM-style block: takes and returns `(hidden, residual)`; the MoE is the blend in every mode."""

    def __init__(self, config: EngineConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)
        self.gen_mlp = SwiGLU(config) if index in config.moe_layers() else None

    def moe(self, x: torch.Tensor, gen_token_mask: torch.Tensor | None) -> torch.Tensor:
        if self.gen_mlp is None:
            return self.mlp(x)
        if gen_token_mask is None:
            if not torch.compiler.is_compiling() and PROBES.is_capturing(x.device):
                raise refuse_capture_without_mask(self.index)
            return self.mlp(x)
        return torch.where(gen_token_mask[..., None], self.gen_mlp(x), self.mlp(x))

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        gen_token_mask: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.moe(hidden, gen_token_mask), residual


def derive_gen_token_mask(input_ids: torch.Tensor, gen_vocab_start_index: int) -> torch.Tensor:
    """Which tokens take the gen expert: ids at or past the gen vocabulary's start."""
    return input_ids >= gen_vocab_start_index


class MammothEngineModel(nn.Module):
    """Embeddings (dual lookup, clamped), decoder layers, final norm, lm_head | gen_head."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.gen_embed_tokens = nn.Embedding(config.gen_vocab_size, config.hidden_size)
        # torch types a ModuleList's items as Module; these are DecoderLayers
        self.layers: Sequence[DecoderLayer] = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))  # type: ignore[assignment]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gen_head = nn.Linear(config.hidden_size, config.gen_vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        start = self.config.gen_vocab_start_index
        ids = input_ids.clamp_min(0)
        text = self.embed_tokens(ids.clamp(0, self.config.vocab_size - 1))
        gen = self.gen_embed_tokens((ids - start).clamp(0, self.config.gen_vocab_size - 1))
        return torch.where((ids >= start)[..., None], gen, text)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None = None,
        inputs_embeds: torch.Tensor | None = None,
        gen_token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if gen_token_mask is None and input_ids is not None:
            gen_token_mask = derive_gen_token_mask(input_ids, self.config.gen_vocab_start_index)
        if inputs_embeds is not None:
            hidden = inputs_embeds
        elif input_ids is not None:
            hidden = self.embed(input_ids)
        else:
            raise ValueError("engine: forward needs input_ids or inputs_embeds")
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, gen_token_mask, None if kv_caches is None else kv_caches[i])
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.lm_head(hidden), self.gen_head(hidden)], dim=-1)

    def allocate_kv_caches(self, batch: int, max_len: int) -> list[torch.Tensor]:
        c = self.config
        shape = (2, batch, c.num_key_value_heads, max_len, c.head_dim)
        weight = self.lm_head.weight
        return [torch.zeros(shape, device=weight.device, dtype=weight.dtype) for _ in range(c.num_hidden_layers)]

    # ---- the engine's weight loader ----

    # Checkpoint prefixes the loader accepts, first match wins: the release's composite model
    # (`llm_model.`, a nested `model.language_model.`), the standalone LLM, and the parity layout.
    PREFIXES = ("llm_model.model.language_model.", "llm_model.model.", "llm_model.", "model.language_model.", "model.", "")
    SKIPPED = ("visual.", "gen_transformer.", "gen_vae.", "gen_image_condition_refiner.")
    # vLLM's stacked-parameter mapping: (checkpoint fragment, fused parameter fragment, shard).
    STACKED = (
        (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q_proj"),
        (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k_proj"),
        (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v_proj"),
        (".mlp.gate_proj.", ".mlp.gate_up_proj.", "gate_proj"),
        (".mlp.up_proj.", ".mlp.gate_up_proj.", "up_proj"),
        (".gen_mlp.gate_proj.", ".gen_mlp.gate_up_proj.", "gate_proj"),
        (".gen_mlp.up_proj.", ".gen_mlp.gate_up_proj.", "up_proj"),
    )

    def parameter_for(self, name: str) -> tuple[str, str | None] | None:
        """(engine parameter, shard of a fused one or None) for a checkpoint tensor; None for a
        tensor the engine does not serve (vision tower, DiT, VAE)."""
        prefix = next(p for p in self.PREFIXES if name.startswith(p))
        local = name[len(prefix) :]
        if local.startswith(self.SKIPPED):
            return None
        for fragment, fused, shard in self.STACKED:
            if fragment in f".{local}":
                return f".{local}".replace(fragment, fused)[1:], shard
        return local, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[str]]:
        """Adopt checkpoint tensors (shards copied into their fused parameter's rows); returns, per
        parameter, the checkpoint names it was filled from. Raises naming what is missing."""
        params = dict(self.named_parameters())
        filled: dict[str, list[str]] = {}
        for name, tensor in weights:
            found = self.parameter_for(name)
            if found is None:
                continue
            target, shard = found
            if target not in params:
                raise KeyError(f"engine: checkpoint tensor {name} has no parameter ({target})")
            rows = params[target].data
            if shard is not None:
                owner = self.get_submodule(target.rsplit(".", 1)[0])
                if not isinstance(owner, MergedLinear):
                    raise TypeError(f"engine: checkpoint tensor {name} is a shard of {target}, which stacks none")
                order = list(owner.shards)
                offset = sum(owner.shards[key] for key in order[: order.index(shard)])
                rows = rows[offset : offset + owner.shards[shard]]
            rows.copy_(tensor)
            filled.setdefault(target, []).append(name)
        missing = [p for p in params if len(filled.get(p, [])) != _sources(self, p)]
        if missing:
            raise KeyError(f"engine: parameters without (all of) their checkpoint tensors: {missing}")
        return filled


def _sources(model: nn.Module, name: str) -> int:
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    return len(owner.shards) if isinstance(owner, MergedLinear) else 1


def read_checkpoint(directory: str | Path) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    """config.json and every tensor of a safetensors directory (single file, shards with any index)."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if indexes:
        files = sorted({f for index in indexes for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for filename in files:
            with safe_open(str(directory / filename), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)

    return config, tensors()


def build_engine_model(
    config: EngineConfig, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device | str, dtype: torch.dtype
) -> tuple[MammothEngineModel, dict[str, list[str]]]:
    with torch.device(device):
        model = MammothEngineModel(config).to(dtype)
    filled = model.load_weights(weights)
    return model.eval().requires_grad_(False), filled

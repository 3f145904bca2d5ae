"""A MammothModa2 AR backbone written the way a Meta-Llama-style reference repository writes it.

This is an *engine's* code, not the harness's: it imports nothing from parity, serving_models or
reference_models, and it registers no hooks of its own. It is the second worked example of a
third-party target (the first, `examples/engine_target`, is vLLM-shaped); what makes it different:

- its own module names: `tok_embeddings`, `attention_norm`, `attention.wqkv` (q|k|v fused),
  `attention.wo`, `ffn_norm`, `ffn.text.w13` / `ffn.image.w13` (gate|up fused) and `w2`, `output`
  and `gen_output` for the heads;
- one **joint rotary module**, `attention.rotary(q, k, positions) -> (q, k)`, tokens-first
  (`[batch, tokens, heads, head_dim]`);
- plain residual blocks (`x + attention(...)`, then `h + ffn(...)`), no fused residual;
- the per-layer hidden states collected by the forward itself (returned beside the output);
- the two experts behind one module, `ffn`, that blends them by the gen-token mask;
- KV caches token-major, `[batch, max_len, kv_heads, head_dim]`, written by indexed assignment;
- its own checkpoint loader: a table from checkpoint names (parity's layout or the release's
  prefixed one) to its parameters, row offsets for the fused ones.

The parity adapter over it is `examples/llama_style_target/parity_target.py`.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn


class Probes:
    """The capture question, per device type: the engine asks it before any branch on a value."""

    def __init__(self) -> None:
        self.table: dict[str, Callable[[], bool]] = {"cuda": torch.cuda.is_current_stream_capturing, "cpu": lambda: False}
        self.warned: set[str] = set()

    def register_capture_probe(self, backend: str, probe: Callable[[], bool] | None) -> Callable[[], bool] | None:
        previous = self.table.pop(backend, None)
        if probe is not None:
            self.table[backend] = probe
        return previous

    @contextmanager
    def capture_probe(self, backend: str, probe: Callable[[], bool] | None) -> Iterator[None]:
        previous = self.register_capture_probe(backend, probe)
        try:
            yield
        finally:
            self.register_capture_probe(backend, previous)

    def is_capturing(self, device: torch.device | str) -> bool:
        kind = torch.device(device).type
        probe = self.table.get(kind)
        if probe is None:
            if kind not in self.warned:
                self.warned.add(kind)
                warnings.warn(f"llama-style engine: no capture probe for {kind}; treated as not capturing", stacklevel=2)
            return False
        return bool(probe())


PROBES = Probes()


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    gen_vocab_size: int
    gen_start: int
    norm_eps: float
    rope_theta: float
    image_layers: tuple[int, ...]  # the layers with a gen ("image") expert

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_config(cls, config: Mapping | object) -> ModelArgs:
        """From a config.json (flat, or the release's `llm_config.text_config`) or a config object."""
        if not isinstance(config, Mapping):  # the reference's config object: upstream names as attributes
            config = dict(vars(config))
        if "llm_config" in config:
            llm = config["llm_config"]
            config = {**llm.get("text_config", {}), **{k: v for k, v in llm.items() if k != "text_config"}}
        layers = int(config["num_hidden_layers"])
        kind, _, span = str(config.get("moe_type", "ffn")).partition("-")
        image: tuple[int, ...]
        if "ffn" not in kind:
            image = ()
        elif span:
            first, last = (int(v) for v in span.split(":"))
            image = tuple(range(first, min(last, layers)))
        else:
            image = tuple(range(layers))
        return cls(
            dim=int(config["hidden_size"]),
            n_layers=layers,
            n_heads=int(config["num_attention_heads"]),
            n_kv_heads=int(config["num_key_value_heads"]),
            ffn_dim=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            gen_vocab_size=int(config["gen_vocab_size"]),
            gen_start=int(config.get("gen_vocab_start_index", config["vocab_size"])),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 1_000_000.0)),
            image_layers=image,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


class Rotary(nn.Module):
    """q and k rotated together (rotate-half pairs), tokens-first: `[B, L, heads, head_dim]`."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        work = torch.promote_types(q.dtype, torch.float32)
        steps = torch.arange(0, self.head_dim, 2, device=q.device).to(work) / self.head_dim
        angles = positions.to(work)[..., None] / (self.theta**steps)  # [B, L, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)

        def turn(x: torch.Tensor) -> torch.Tensor:
            first, second = x.chunk(2, dim=-1)
            return x * cos + torch.cat([-second, first], dim=-1) * sin

        return turn(q), turn(k)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.widths = (args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.n_kv_heads * args.head_dim)
        self.wqkv = nn.Linear(args.dim, sum(self.widths), bias=True)
        self.rotary = Rotary(args.head_dim, args.rope_theta)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = self.wqkv(x).split(self.widths, dim=-1)
        q, k = self.rotary(
            q.view(b, length, self.n_heads, self.head_dim), k.view(b, length, self.n_kv_heads, self.head_dim), positions
        )
        v = v.view(b, length, self.n_kv_heads, self.head_dim)
        if cache is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
        else:
            keys, values = cache
            rows = torch.arange(b, device=x.device)[:, None]
            keys[rows, positions] = k  # token-major cache: [B, max_len, kv_heads, head_dim]
            values[rows, positions] = v
            visible = torch.arange(keys.shape[1], device=x.device)[None, None, None, :] <= positions[:, None, :, None]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=visible, enable_gqa=True
            )
        return self.wo(out.transpose(1, 2).reshape(b, length, -1))


class FeedForward(nn.Module):
    """`w2(silu(gate) * up)`, gate|up in one matrix `w13`."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TwoExperts(nn.Module):
    """The text expert for text tokens, the image expert (where the layer has one) for gen tokens."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.text = FeedForward(args.dim, args.ffn_dim)
        self.image = FeedForward(args.dim, args.ffn_dim) if layer in args.image_layers else None

    def forward(self, h: torch.Tensor, gen_mask: torch.Tensor | None, capturing: bool = False) -> torch.Tensor:
        if self.image is None:
            return self.text(h)
        if gen_mask is None:
            if capturing:
                raise RuntimeError(
                    f"model.layers.{self.layer}: no gen-token mask while a graph is captured, so the experts cannot be "
                    "chosen per token; serve this request with enforce_eager=True (PIECEWISE is not a workaround: "
                    "every piece still holds this layer's experts)"
                )
            return self.text(h)
        return torch.where(gen_mask[..., None], self.image(h), self.text(h))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn = TwoExperts(args, layer)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        gen_mask: torch.Tensor | None,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        capturing: bool = False,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), positions, cache)
        return h + self.ffn(self.ffn_norm(h), gen_mask, capturing)


class Transformer(nn.Module):
    requires_raw_input_tokens = True  # the runner hands the ids beside the embeddings

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.gen_tok_embeddings = nn.Embedding(args.gen_vocab_size, args.dim)
        # torch types a ModuleList's items as Module: the Sequence annotation keeps them Blocks for the type checker
        self.layers: Sequence[Block] = nn.ModuleList(Block(args, i) for i in range(args.n_layers))  # type: ignore[assignment]
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.gen_output = nn.Linear(args.dim, args.gen_vocab_size, bias=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        a = self.args
        tokens = tokens.clamp_min(0)
        gen = tokens >= a.gen_start
        text_rows = self.tok_embeddings(tokens.clamp(max=a.vocab_size - 1))
        gen_rows = self.gen_tok_embeddings((tokens - a.gen_start).clamp(0, a.gen_vocab_size - 1))
        return torch.where(gen[..., None], gen_rows, text_rows)

    def forward(
        self,
        tokens: torch.Tensor | None,
        positions: torch.Tensor,
        *,
        embeddings: torch.Tensor | None = None,
        gen_mask: torch.Tensor | None = None,
        caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the final-normed hidden states, every layer's output): the second is what a debugger reads."""
        if gen_mask is None and tokens is not None:
            gen_mask = tokens >= self.args.gen_start
        if embeddings is None:
            if tokens is None:
                raise ValueError("Transformer.forward needs tokens or embeddings")
            embeddings = self.embed(tokens)
        h = embeddings
        # asked once per forward, ids or not (a traced graph cannot ask: compiled code is never capturing here)
        capturing = not torch.compiler.is_compiling() and PROBES.is_capturing(h.device)
        states = []
        for i, block in enumerate(self.layers):
            h = block(h, positions, gen_mask, None if caches is None else caches[i], capturing)
            states.append(h)
        return self.norm(h), states

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.output(h), self.gen_output(h)], dim=-1)

    def new_caches(self, batch: int, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        a, like = self.args, self.output.weight
        shape = (batch, max_len, a.n_kv_heads, a.head_dim)
        return [(like.new_zeros(shape), like.new_zeros(shape)) for _ in range(a.n_layers)]


# ----------------------------------------------------------------------------------------------
# The loader: checkpoint name -> (parameter, which rows of it)
# ----------------------------------------------------------------------------------------------

_LAYER = re.compile(r"(?:.*\.)?layers\.(\d+)\.(.+)$")
_TOP = {"embed_tokens.weight": "tok_embeddings.weight", "gen_embed_tokens.weight": "gen_tok_embeddings.weight"}
_TOP |= {"norm.weight": "norm.weight", "lm_head.weight": "output.weight", "gen_head.weight": "gen_output.weight"}
_IN_LAYER = {
    "input_layernorm.weight": ("attention_norm.weight", None),
    "post_attention_layernorm.weight": ("ffn_norm.weight", None),
    "self_attn.o_proj.weight": ("attention.wo.weight", None),
    **{f"self_attn.{p}_proj.{kind}": (f"attention.wqkv.{kind}", i) for i, p in enumerate("qkv") for kind in ("weight", "bias")},
    **{
        f"{theirs}.{proj}_proj.weight": (f"ffn.{ours}.{'w13' if proj != 'down' else 'w2'}.weight", {"gate": 0, "up": 1}.get(proj))
        for theirs, ours in (("mlp", "text"), ("gen_mlp", "image"))
        for proj in ("gate", "up", "down")
    },
}
_SKIP = ("visual.", "gen_transformer.", "gen_vae.", "gen_image_condition_refiner.")


def place(name: str) -> tuple[str, int | None] | None:
    """(parameter, block of a fused one) for a checkpoint tensor; None for one the LLM does not use."""
    if any(part in name for part in _SKIP):
        return None
    layer = _LAYER.match(name)
    if layer:
        found = _IN_LAYER.get(layer[2])
        return None if found is None else (f"layers.{layer[1]}.{found[0]}", found[1])
    for suffix, ours in _TOP.items():
        if name == suffix or name.endswith("." + suffix) or name.endswith("model." + suffix):
            return ours, None
    return None


def load(model: Transformer, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[str]]:
    """Copy every checkpoint tensor into its parameter (a fused one block by block, in the order of
    its blocks); returns parameter -> the checkpoint names it holds."""
    params = dict(model.named_parameters())
    sources: dict[str, list[str]] = {}
    for name, tensor in tensors:
        placed = place(name)
        if placed is None:
            continue
        param, block = placed
        if param not in params:
            raise KeyError(f"llama-style engine: {name} maps to {param}, which this model does not have")
        rows = params[param].data
        if block is not None:
            size = rows.shape[0] // (3 if ".wqkv." in param else 2)
            if ".wqkv." in param:  # q rows, then k and v (kv heads may be fewer than q heads)
                q = model.args.n_heads * model.args.head_dim
                kv = model.args.n_kv_heads * model.args.head_dim
                start, size = (0, q) if block == 0 else (q + (block - 1) * kv, kv)
            else:
                start = block * size
            rows = rows[start : start + size]
        rows.copy_(tensor)
        sources.setdefault(param, []).append(name)
    return sources


def read(directory: str | Path) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    """config.json and the tensors of every safetensors file in the directory."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    yield name, handle.get_tensor(name)

    return config, tensors()


def build(config: Mapping | object, tensors: Iterable[tuple[str, torch.Tensor]], device, dtype) -> tuple[Transformer, dict]:
    with torch.device(device):
        model = Transformer(ModelArgs.from_config(config)).to(dtype)
    sources = load(model, tensors)
    return model.eval().requires_grad_(False), sources

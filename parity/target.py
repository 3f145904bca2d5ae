"""Resolving `--target`: which implementation the suites run against.

`serving` (the built-in serving-style models) and `reference` (the upstream-faithful models: a
valid, trivially passing run) are names for factories in the model packages; anything else is
`package.module:factory`, a zero-argument callable returning a target object. The harness imports
the factory by name only when a suite asks for the target, so `parity/` itself imports no model.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

BUILTIN_TARGETS = {
    "serving": "serving_models.target:make_target",
    "reference": "reference_models.target:make_target",
}


class TargetError(RuntimeError):
    """`--target` names something that cannot be loaded; the message says what and why."""


def factory_path(spec: str) -> str:
    """`serving` -> `serving_models.target:make_target`; `pkg.mod:fn` is returned unchanged."""
    if spec in BUILTIN_TARGETS:
        return BUILTIN_TARGETS[spec]
    if ":" not in spec:
        raise TargetError(f"--target {spec!r}: expected one of {', '.join(BUILTIN_TARGETS)} or 'package.module:factory'")
    return spec


def load_target(spec: str) -> Any:
    """Import and call the target factory named by `spec`; the object it returns is the target."""
    path = factory_path(spec)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetError(f"--target {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise TargetError(f"--target {spec!r}: module {module_name!r} has no callable {attr!r}")
    target = factory()
    if not getattr(target, "name", None):
        raise TargetError(f"--target {spec!r}: the factory returned {type(target).__name__} without a 'name'")
    return target


# ---------------------------------------------------------------------------------------------
# The adapter contract (what the suites call). Structural: an engine's own adapters need not
# import anything from here, only have these members. `missing_members` names what is absent.
# ---------------------------------------------------------------------------------------------


class CaptureRegistry(Protocol):
    """The target-owned capture-probe registry (see `serving_models/common/capture.py`)."""

    def register_capture_probe(self, backend: str, probe: Callable[[], bool] | None) -> Any: ...
    def capture_probe(self, backend: str, probe: Callable[[], bool] | None) -> Any: ...
    def is_capturing(self, device: Any) -> bool: ...


class ARAdapter(Protocol):
    """The AR backbone. `forward` returns `(logits [B, L, vocab + gen_vocab], hidden_states)` with one
    hidden state per decoder layer (before the final norm); `moe_sites()` gives, per MoE layer,
    `(layer, pre_norm, layer_module, und, gen)` where the MoE input is `pre_norm`'s output, the
    residual is its input and `layer_module` returns `residual + moe(input)`: the harness observes
    which expert's output a token got through forward hooks on these modules.

    Optional, for mask-keyed decode graphs (docs/model.md §4): `decode_graph_keys` (the graphs to
    capture per batch size), `select_decode_graph(key)` (host state: what `decode_step` runs and a
    capture bakes; None restores the default) and `decode_graph_key(generating) -> key` (the graph
    a batch replays, from per-row host-side bools). Without them the harness captures one graph."""

    name: str
    config: Any
    module: Any
    moe_layers: tuple[int, ...]
    supports_capture: bool

    def moe_sites(self) -> list[Any]: ...
    def embedding_modules(self) -> tuple[Any, Any]: ...
    def weight_name_map(self) -> dict[str, list[str]]: ...
    def embed(self, input_ids: Any) -> Any: ...
    def forward(self, input_ids: Any = None, inputs_embeds: Any = None, gen_token_mask: Any = None) -> Any: ...
    def forward_multimodal(self, inputs_embeds: Any, input_ids: Any) -> Any: ...
    def allocate_decode_state(self, batch: int, max_len: int) -> Any: ...
    def prefill(self, input_ids: Any) -> Any: ...
    def decode_step(self, input_ids: Any, positions: Any) -> Any: ...
    def greedy_generate(self, input_ids: Any, max_new_tokens: int, step_fn: Any = None) -> Any: ...


class DiTAdapter(Protocol):
    """The DiT stage: velocity of one denoising step, block sites in execution order, and the
    whole pipeline (sample with CFG, decode to uint8 RGB). Sizes are latent sizes."""

    name: str
    config: Any
    module: Any

    def forward(self, latents: Any, timestep: Any, text_states: Any, text_mask: Any) -> Any: ...
    def block_sites(self) -> list[tuple[str, Any]]: ...
    def sample(
        self,
        text_states: Any,
        text_mask: Any,
        height: int,
        width: int,
        steps: int,
        guidance_scale: float,
        cfg_range: Any = ...,
        seed: int = 0,
    ) -> Any: ...
    def decode(self, latents: Any) -> Any: ...
    def text_condition(self, length: int, seed: int, batch: int = 1) -> Any: ...


class RouterAdapter(Protocol):
    """The MoE top-k router: `select_experts` returns `(weights fp32 [T, k+S], ids int32 [T, k+S])`;
    rows at or past the device-side `num_valid_rows` are -1 / 0."""

    name: str

    def select_experts(self, logits: Any, k: int, **options: Any) -> Any: ...
    def make_experts(self, gate_proj: Any, up_proj: Any, down_proj: Any) -> Any: ...
    def apply_experts(self, x: Any, result: Any, experts: Any) -> Any: ...
    def remap(self, ids: Any, replica_table: Any, row_choice: Any) -> Any: ...
    def expert_load(self, ids: Any, num_valid_rows: Any, num_physical: int) -> Any: ...


class Target(Protocol):
    """What `make_target()` returns. A family the target does not implement may be left out:
    the suites of that family then skip with a reason naming the missing member."""

    name: str
    capture: CaptureRegistry

    def load_ar(self, checkpoint_dir: Any, device: Any, dtype: Any) -> ARAdapter: ...
    def build_ar(self, config: Any, state_dict: Any, device: Any, dtype: Any) -> ARAdapter: ...
    def load_dit(self, checkpoint_dir: Any, device: Any, dtype: Any) -> DiTAdapter: ...
    def build_dit(self, config: Any, state_dict: Any, device: Any, dtype: Any) -> DiTAdapter: ...
    def router(self) -> RouterAdapter: ...


def missing_members(obj: Any, protocol: type) -> list[str]:
    """Members of `protocol` that `obj` lacks (attributes and methods), in declaration order."""
    names = list(getattr(protocol, "__annotations__", {}))
    names += [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    return [n for n in dict.fromkeys(names) if not hasattr(obj, n)]


def require(obj: Any, protocol: type, what: str) -> Any:
    """Return `obj` if it has every member of `protocol`, else raise a TargetError naming the gaps."""
    missing = missing_members(obj, protocol)
    if missing:
        raise TargetError(f"{what} ({type(obj).__name__}) lacks {protocol.__name__} members: {', '.join(missing)}")
    return obj

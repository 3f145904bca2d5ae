"""Shared pieces of the AR suites: the case tables, token resolution, the model pair, observation.

The expert a token actually got is observed, never asked: forward hooks (the runners' taps) on
each MoE layer's post-attention norm give the MoE input `x` and the residual `h`, the layer's
output minus `h` is the MoE output, and the harness recomputes both experts on `x` itself. The
output matches one expert's and not the other's, in every execution mode, replays included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
import torch

from parity.cases import Count, NonNegative, Range, Steps, Table, load_case_file
from parity.compare import NOT_APPLICABLE, Tolerance, Verdict, dtype_spacing, golden_noise_rule
from parity.plugin.session import RunSession
from parity.suites.ar import golden as ar_golden
from parity.suites.device_memory import require_device_bytes
from parity.target import ARAdapter, Target
from reference_models.ar.adapter import ReferenceARAdapter
from reference_models.ar.config import ar_config, token_layout
from reference_models.checkpoints import make_checkpoint, random_state_dict

Token = int | str
# A prompt: 1..MAX_BATCH rows of 1..MAX_TOKENS tokens (an empty row or batch is refused when the
# case file is read; the model's own position limit is checked when the prompt is built).
MAX_BATCH, MAX_TOKENS = 64, 8192
PromptRows = Annotated[list[Annotated[list[Token], Range(1, MAX_TOKENS)]], Range(1, MAX_BATCH)]
Layer = Annotated[int, Range(0, 1023)]


def _equal_rows(rows: Sequence[Sequence[Token]]) -> None:
    lengths = sorted({len(row) for row in rows})
    if len(lengths) > 1:
        raise ValueError(f"the rows of a batch must have one length, got lengths {lengths}")


@dataclasses.dataclass(frozen=True)
class Prompt:
    name: str
    rows: PromptRows

    def __post_init__(self) -> None:
        _equal_rows(self.rows)


@dataclasses.dataclass(frozen=True)
class ClampCase:
    name: str
    token: Token
    expect: Literal["base:0", "base:last", "gen:0", "gen:last"]


@dataclasses.dataclass(frozen=True)
class ClampCompile:
    lengths: Annotated[list[Annotated[int, Range(1, MAX_TOKENS)]], Range(1, None)]
    expected_compiles: Count
    reason: str


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    name: str
    prompt: PromptRows
    steps: Steps
    require_crossing: bool
    # Ids between the text table's end and the gen start (the Dev layout, docs/checkpoints.md §4):
    # the case runs on models rebuilt through `build_ar` with a text table this much shorter than
    # the gen start (`vocab_gap_models`); 0, the checkpoint's own layout.
    vocab_gap: Count = 0

    def __post_init__(self) -> None:
        _equal_rows(self.prompt)


@dataclasses.dataclass(frozen=True)
class Observation:
    residual_ulps: NonNegative
    reason: str


@dataclasses.dataclass(frozen=True)
class RoutingCompile:
    backend: Literal["aot_eager", "eager", "inductor"]
    reason: str


@dataclasses.dataclass(frozen=True)
class MoERange:
    name: str
    moe_type: str
    expected_layers: list[Layer]


@dataclasses.dataclass(frozen=True)
class RecompileWarmup:
    batch: int
    length: int
    expected_compiles: int
    reason: str


@dataclasses.dataclass(frozen=True)
class RecompileLattice:
    backend: str
    backend_reason: str
    batch_sizes: list[int]
    lengths: list[int]
    warmup: list[RecompileWarmup]

    def __post_init__(self) -> None:
        if not self.warmup:
            raise ValueError("cases/ar.toml [recompiles]: a lattice needs at least one warm-up point")
        if min(self.batch_sizes + self.lengths + [w.batch for w in self.warmup] + [w.length for w in self.warmup]) < 1:
            raise ValueError("cases/ar.toml [recompiles]: batch sizes and lengths must be >= 1")


@dataclasses.dataclass(frozen=True)
class NoiseFloorRule:
    reason: str


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    tie_spacings: NonNegative
    reason: str
    bucket_steps: Steps
    bucket_reason: str

    def __post_init__(self) -> None:
        if self.bucket_steps < 1:
            raise ValueError(f"cases/ar.toml [decode_settings]: bucket_steps must be at least 1, got {self.bucket_steps}")


CASES = load_case_file(
    "ar.toml",
    {
        "tolerances": Table(Tolerance, keyed=True),
        "prompts": Table(Prompt),
        "clamp": Table(ClampCase),
        "clamp_compile": Table(ClampCompile, many=False),
        "decode": Table(DecodeCase),
        "decode_settings": Table(DecodeSettings, many=False),
        "moe_ranges": Table(MoERange),
        "observation": Table(Observation, many=False),
        "routing_compile": Table(RoutingCompile, many=False),
        "noise_floor": Table(NoiseFloorRule, many=False),
        "recompiles": Table(RecompileLattice, many=False),
    },
)
NOISE_FLOOR: NoiseFloorRule = CASES["noise_floor"]
TOL: dict[str, Tolerance] = CASES["tolerances"]
PROMPTS: list[Prompt] = CASES["prompts"]


def ids_of(items: Sequence[Any]) -> list[str]:
    return [item.name for item in items]


# ---------------------------------------------------------------------------------------------
# Tokens
# ---------------------------------------------------------------------------------------------


def resolve_token(token: Token, config: Any, size: str) -> int:
    """The id a case token stands for in this configuration (see the header of cases/ar.toml)."""
    if isinstance(token, int):
        return token
    start, gen = config.gen_vocab_start_index, config.gen_vocab_size
    fixed = {"start-1": start - 1, "start": start, "start+gen-1": start + gen - 1, "start+gen": start + gen, "huge": 2**40}
    if token in fixed:
        return fixed[token]
    kind, _, number = token.partition(":")
    if kind == "g" and number.isdigit() and int(number) < gen:
        return start + int(number)
    name = "visual_start" if kind == "visual" else token
    if name not in ("eol", "eof", "image_start", "image_end", "visual_start") or (kind == "visual" and not number.isdigit()):
        raise ValueError(f"cases/ar.toml: token {token!r} is not a token of the case grammar")
    offset = int(number) if kind == "visual" else 0
    special = getattr(token_layout(size), name)
    if special is None:
        # The full configuration's offsets of these gen tokens are unconfirmed (docs/model.md §3): use the
        # tiny layout's offset from the gen start, so the case keeps its shape (a gen token there).
        tiny = token_layout("tiny")
        special = start + getattr(tiny, name) - ar_config("tiny").gen_vocab_start_index
    return special + offset


def token_tensor(rows: Sequence[Sequence[Token]], config: Any, size: str, device: torch.device) -> torch.Tensor:
    lengths = {len(row) for row in rows}
    if len(lengths) != 1:
        raise ValueError(f"cases/ar.toml: batch rows must have equal lengths, got {sorted(lengths)}")
    return torch.tensor([[resolve_token(t, config, size) for t in row] for row in rows], dtype=torch.long, device=device)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ARModels:
    """The target under test, the reference in the same dtype and the fp64 golden (the truth the
    numeric gates measure both against, in every dtype)."""

    target: ARAdapter
    reference: ReferenceARAdapter
    golden: ReferenceARAdapter
    config: Any
    size: str
    device: torch.device
    dtype: torch.dtype
    checkpoint_dir: Path | None
    seed: int
    # the reference's and the golden's forward per input ids, computed once per session: every
    # mode of every suite judges against the same truth (on the GPU lane the fp64 golden of the
    # 28-layer backbone is the costliest forward of a case)
    _truth: dict[tuple[str, tuple[int, ...], bytes], Any] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def start(self) -> int:
        return self.config.gen_vocab_start_index

    def ids(self, rows: Sequence[Sequence[Token]]) -> torch.Tensor:
        return token_tensor(rows, self.config, self.size, self.device)

    def _forward_once(self, which: str, ids: torch.Tensor) -> Any:
        key = (which, tuple(ids.shape), ids.detach().cpu().numpy().tobytes())
        if key not in self._truth:
            self._truth[key] = getattr(self, which).forward(ids)
        return self._truth[key]

    def reference_forward(self, ids: torch.Tensor) -> Any:
        """`reference.forward(ids)`, computed once per distinct ids (callers must not change it in place)."""
        return self._forward_once("reference", ids)

    def golden_forward(self, ids: torch.Tensor) -> Any:
        """`golden.forward(ids)` (fp64), computed once per distinct ids (callers must not change it in place)."""
        return self._forward_once("golden", ids)


def build_ar_models(settings: RunSession, target: Target, tmp_path_factory: pytest.TempPathFactory) -> ARModels:
    """The target, the reference in the same dtype and the fp64 golden, from one seed. The golden
    streams (`parity.suites.ar.golden`, docs/lanes.md §4): at tiny size from the checkpoint held on
    the host, at full size from the seeded draws, one unit at a time on the device."""
    device, dtype = torch.device(settings.device), settings.torch_dtype
    config = ar_config(settings.size)
    seed = settings.seed
    if settings.size == "tiny":
        layout = getattr(settings, "checkpoint_layout", "parity")
        checkpoint = make_checkpoint("ar", "tiny", seed, tmp_path_factory.mktemp("ar-checkpoint"), layout=layout)
        model = target.load_ar(checkpoint, device, dtype)
        reference = ReferenceARAdapter.load(checkpoint, device, dtype)
        golden = ar_golden.from_checkpoint(checkpoint, device)
    else:  # full size: weights drawn on the device, never written to disk
        checkpoint = None
        require_device_bytes("full-size AR", full_size_need(config, dtype), device)
        state = random_state_dict(config, seed, device, dtype)
        model = target.build_ar(config, state, device, dtype)
        reference = ReferenceARAdapter.build(config, state, device, dtype)
        del state
        golden = ar_golden.from_draws(config, seed, device)
    return ARModels(model, reference, golden, config, settings.size, device, dtype, checkpoint, seed)


def vocab_gap_models(models: ARModels, target: Target, gap: int) -> ARModels:
    """`models` rebuilt in the Dev vocabulary layout (docs/checkpoints.md §4): the text table `gap`
    rows shorter than the gen start, the gen ids where they were; the target through `build_ar`, the
    reference and the fp64 golden from the same seeded draws, on the same device and dtype."""
    if not 0 < gap < models.config.vocab_size:
        raise ValueError(
            f"cases/ar.toml: vocab_gap {gap} must lie in [1, {models.config.vocab_size - 1}] (the text table's size)"
        )
    config = dataclasses.replace(models.config, vocab_size=models.config.vocab_size - gap)
    state = random_state_dict(config, models.seed, models.device, models.dtype)
    variant = target.build_ar(config, state, models.device, models.dtype)
    reference = ReferenceARAdapter.build(config, state, models.device, models.dtype)
    truth = random_state_dict(config, models.seed, models.device, torch.float64)
    golden = ReferenceARAdapter.build(config, truth, models.device, torch.float64)
    return ARModels(variant, reference, golden, config, models.size, models.device, models.dtype, None, models.seed)


def full_size_need(config: Any, dtype: torch.dtype) -> dict[str, int]:
    """Device bytes of the full-size AR family by part: the target and the reference whole in the
    run's dtype (the reference shares the drawn state's tensors, so the build holds no third copy),
    and the streamed fp64 golden's largest unit with its fp32 draw."""
    weights = ar_golden.ar_parameters(config) * dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    return {
        f"target {name}": weights,
        f"reference {name}": weights,
        "streamed float64 golden (largest unit)": ar_golden.unit_bytes(config, torch.float64),
    }


COMPILED_MODES = ("compiled", "compiled_cuda_graph")


def skip_full_size_compile(models: ARModels, mode: str) -> None:
    """The whole 28-layer Preview backbone under Inductor costs minutes per shape and several
    shapes per suite, past the GPU lane's budget; the compiled AR modes run on the tiny model in
    both lanes (the same code paths), and the full-size lane runs eager and real CUDA graphs."""
    if models.size == "full" and mode in COMPILED_MODES:
        pytest.skip(f"{mode} of the full-size AR backbone: compile time per shape is past the GPU lane's budget")


# ---------------------------------------------------------------------------------------------
# Judging a tensor: the fp64-golden noise floor, in every dtype
# ---------------------------------------------------------------------------------------------


def judge(candidate: torch.Tensor, reference: torch.Tensor, golden: torch.Tensor, *, name: str) -> Verdict:
    """The candidate may be at most the multiplier times as far (RMSE) from the fp64 golden as the
    reference in the candidate's dtype is, plus the golden's own rounding to that dtype
    (`parity.compare.golden_noise_rule`; cases/ar.toml [noise_floor] says why)."""
    verdict, _ = golden_noise_rule(golden, reference, candidate, name=name, reason=NOISE_FLOOR.reason)
    return verdict


# ---------------------------------------------------------------------------------------------
# Observing which expert a token got
# ---------------------------------------------------------------------------------------------


def moe_taps(adapter: Any) -> dict[str, torch.nn.Module]:
    """Taps that let the harness recover each MoE layer's input, residual and output."""
    taps: dict[str, torch.nn.Module] = {}
    for site in adapter.moe_sites():
        taps[f"pre_norm.{site.layer}"] = site.pre_norm
        taps[f"layer.{site.layer}"] = site.layer_module
    return taps


@dataclasses.dataclass(frozen=True)
class ExpertUse:
    """Per token of one MoE layer: which expert's output the layer used, and how clearly."""

    layer: int
    used_gen: torch.Tensor  # bool [B, L]
    matched: torch.Tensor  # bool [B, L]: the output is the chosen candidate's and not the other's
    distance_und: torch.Tensor  # max |out - (h + und(x))| per token
    distance_gen: torch.Tensor
    # The same output judged by the reference's experts on the same input: True where it is nearer
    # the reference's gen expert than its und expert (None: not judged). The target's own modules
    # cannot tell which weights they hold: a loader that swapped the two experts' tensors routes
    # every token "right" by its own modules, and only the reference's weights see it.
    used_gen_by_reference: torch.Tensor | None = None


def moe_observation(norm_call: Any, layer_call: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """`(x, residual, out, add_residual)` of one MoE layer's tapped calls, in either form a target
    may have (parity.target.ARAdapter):

    * plain: `pre_norm(h) -> x` and `layer_module(...) -> h + moe(x)`: `out` is the layer's output
      and a candidate expert's output is compared as `h + expert(x)` (`add_residual` True);
    * fused residual (vLLM style): `pre_norm(hidden, residual) -> (x, h)` with the residual add
      fused into the norm, and `layer_module(...) -> (moe(x), h)` leaving the add to the next
      layer's norm: `out` is `moe(x)` and a candidate is `expert(x)` itself (`add_residual` False).
    """
    norm_out, layer_out = norm_call.output, layer_call.output
    fused_norm, fused_layer = isinstance(norm_out, (tuple, list)), isinstance(layer_out, (tuple, list))
    if fused_norm != fused_layer:
        raise TypeError(
            f"MoE layer {layer}: pre_norm returned {type(norm_out).__name__}, layer_module {type(layer_out).__name__}; "
            "both plain tensors or both (out, residual) pairs (docs/targets.md §4)"
        )
    if not fused_norm:
        return norm_out, norm_call.input, layer_out, True
    if len(norm_out) != 2 or len(layer_out) != 2:
        raise TypeError(
            f"MoE layer {layer}: fused-residual taps must be (out, residual) pairs, got {len(norm_out)} and "
            f"{len(layer_out)} values (docs/targets.md §4)"
        )
    (x, residual), (moe_out, _) = norm_out, layer_out
    return x, residual, moe_out, False


def _candidate(expert: Any, x: torch.Tensor, residual: torch.Tensor, add_residual: bool) -> torch.Tensor:
    """What the layer's tapped output would be had it used `expert`, in fp64 for the distance."""
    result = expert(x)
    return (residual + result if add_residual else result).double()


@torch.no_grad()
def observe_expert_use(adapter: Any, taps: dict[str, list[Any]], tol: Tolerance, reference: Any = None) -> list[ExpertUse]:
    """Match each token's layer output against `h + und(x)` and `h + gen(x)`, both computed in
    the model's dtype from the tapped input `x` and residual `h` (the rounding the layer itself
    does), so the chosen expert matches to GEMM-shape rounding at any precision. With `reference`
    (an adapter of the same checkpoint), also which of the reference's two experts, on the same
    `x`, the output is nearer (`ExpertUse.used_gen_by_reference`): no bound, only the nearer one, since
    the two experts' weights differ far more than any rounding while the target's GEMM shapes do not
    match the reference's."""
    ulps = CASES["observation"].residual_ulps
    truth = {site.layer: site for site in reference.moe_sites()} if reference is not None else {}
    uses = []
    for site in adapter.moe_sites():
        (norm_call,) = taps[f"pre_norm.{site.layer}"]
        (layer_call,) = taps[f"layer.{site.layer}"]
        x, residual, out, add_residual = moe_observation(norm_call, layer_call, site.layer)
        out64 = out.double()

        d_und = (out64 - _candidate(site.und, x, residual, add_residual)).abs().amax(-1)
        if site.gen is not None:
            d_gen = (out64 - _candidate(site.gen, x, residual, add_residual)).abs().amax(-1)
        else:
            d_gen = torch.full_like(d_und, float("inf"))
        used_gen = d_gen < d_und
        bound = tol.atol + tol.rtol * out64.abs().amax(-1)
        if out.dtype != torch.float32 and out.dtype != torch.float64:
            bound = bound + ulps * dtype_spacing(out64.abs().amax(-1), out.dtype)
        closer, farther = torch.minimum(d_und, d_gen), torch.maximum(d_und, d_gen)
        matched = (closer <= bound) & (farther > bound)
        by_reference = None
        if site.layer in truth:
            ref = truth[site.layer]
            r_und = (out64 - _candidate(ref.und, x, residual, add_residual)).abs().amax(-1)
            r_gen = (out64 - _candidate(ref.gen, x, residual, add_residual)).abs().amax(-1)
            by_reference = (r_gen < r_und).cpu()
        uses.append(ExpertUse(site.layer, used_gen.cpu(), matched.cpu(), d_und.cpu(), d_gen.cpu(), by_reference))
    return uses


def routing_mismatches(use: ExpertUse, ids: torch.Tensor, start: int) -> list[str]:
    """Tokens whose observed expert differs from the reference routing (`id >= start`), by the
    target's own experts or, where judged, by the reference's weights."""
    expected = (ids >= start).cpu()
    bad = (use.used_gen != expected) | ~use.matched
    if use.used_gen_by_reference is not None:
        bad |= use.used_gen_by_reference != expected
    out = []
    for b, pos in bad.nonzero().tolist():
        got = "neither" if not use.matched[b, pos] else ("gen" if use.used_gen[b, pos] else "und")
        if use.used_gen_by_reference is not None and bool(use.used_gen_by_reference[b, pos]) != bool(expected[b, pos]):
            got += f", by the reference's weights {'gen' if use.used_gen_by_reference[b, pos] else 'und'}"
        want = "gen" if expected[b, pos] else "und"
        out.append(f"row {b} pos {pos} id {int(ids[b, pos])}: {got} (want {want})")
    return out


# ---------------------------------------------------------------------------------------------
# Engine policies a target declares it does not follow (parity.target.ENGINE_POLICIES)
# ---------------------------------------------------------------------------------------------


def declared_not_applicable(target: Any, policy: str) -> str | None:
    """The reason `target` gives for not following engine policy `policy`, or None when it follows it."""
    from parity.target import ENGINE_POLICIES

    if policy not in ENGINE_POLICIES:
        raise KeyError(f"unknown engine policy {policy!r}; known: {', '.join(ENGINE_POLICIES)}")
    reason = (getattr(target, "not_applicable", None) or {}).get(policy)
    return str(reason) if reason else None


def record_policy_not_applicable(report: Any, target: Any, policy: str, *, metrics: Sequence[str], **where: Any) -> bool:
    """When `target` declares `policy` not applicable, write one `not_applicable` row per metric with
    its reason (the check is not judged, and says so) and return True; else write nothing, False."""
    reason = declared_not_applicable(target, policy)
    if reason is None:
        return False
    for metric in metrics:
        report.record(
            metric=metric,
            value=None,
            verdict=NOT_APPLICABLE,
            detail=f"engine policy {policy!r} declared not applicable by target {target.name!r}: {reason}",
            better="",
            **where,
        )
    return True

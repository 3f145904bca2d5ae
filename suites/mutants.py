"""The sensitivity catalogue: known-bad variants of the built-in target, one per defect of the seeds.

A mutant is one small run-time change (a monkeypatch of one named function, or an attribute set
on loaded modules), never an edit of shipped code. Each is reachable as a `--target` factory,
`suites.mutants:mutant_<name with _ for ->`, which applies the change in the process that loads
it and returns the serving target, so any suite can be pointed at it. Each entry says which
defect it stands for, which suite must kill it and, per lane, which tests of that suite to run at
which model size and dtype (`Kill`), or why the mutant cannot apply on that lane (`NotApplicable`:
an equivalent mutant at that configuration, reported as `not_applicable`, never as a pass).

Lanes are named by device: `cpu` (tiny fp32 models, the CPU graph stand-in, Inductor on CPU) and
`cuda` (real CUDA graphs and Inductor on the GPU). Mutants run at tiny size on both lanes unless
their entry says otherwise: the defects are structural (a baked branch, a stale buffer, a wrong
layer range), and tiny models show them through the same code paths as full-size ones.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

LANES = ("cpu", "cuda")


def lane_of(device: str) -> str:
    """The catalogue lane a run on `device` belongs to."""
    return "cuda" if device.startswith("cuda") else "cpu"


@dataclasses.dataclass(frozen=True)
class Kill:
    """The tests that must go red for a mutant on one lane, and the configuration they run at."""

    tests: tuple[str, ...]  # pytest arguments selecting the tests
    size: str = "tiny"
    dtype: str | None = None  # None: the lane's default dtype (fp32 on cpu, bf16 on cuda)
    why: str = ""  # why this selection (or configuration) differs from the other lane's, if it does

    @property
    def config(self) -> tuple[str, str | None]:
        return self.size, self.dtype


@dataclasses.dataclass(frozen=True)
class NotApplicable:
    """A mutant that cannot show on a lane (equivalent there), and why."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    defect: str
    suite: str
    target: str  # the --target spec that loads the mutant
    lanes: Mapping[str, Kill | NotApplicable]

    def on(self, lane: str) -> Kill | NotApplicable:
        """The mutant's kill selection on `lane` (`cpu` or `cuda`)."""
        if lane not in self.lanes:
            raise KeyError(f"mutant {self.name!r} declares no selection for lane {lane!r} (lanes: {sorted(self.lanes)})")
        return self.lanes[lane]

    @property
    def tests(self) -> tuple[str, ...]:
        """The CPU lane's selection (the one a reader runs by hand first)."""
        kill = self.on("cpu")
        return kill.tests if isinstance(kill, Kill) else ()

    @property
    def factory(self) -> str:
        return self.target


CATALOGUE: dict[str, Mutant] = {}
_APPLY: dict[str, Callable[[], None]] = {}


def _lanes(tests: tuple[str, ...], cuda: tuple[str, ...] | Kill | NotApplicable | None) -> dict[str, Kill | NotApplicable]:
    """CPU lane: `tests` at tiny fp32. CUDA lane: the same tests unless `cuda` says otherwise."""
    if cuda is None:
        gpu: Kill | NotApplicable = Kill(tests)
    elif isinstance(cuda, (Kill, NotApplicable)):
        gpu = cuda
    else:
        gpu = Kill(tuple(cuda))
    return {"cpu": Kill(tests), "cuda": gpu}


def mutant(
    name: str,
    *,
    defect: str,
    suite: str,
    tests: tuple[str, ...],
    cuda: tuple[str, ...] | Kill | NotApplicable | None = None,
) -> Callable:
    """Register the decorated function as the run-time change of mutant `name`."""

    def register(apply: Callable[[], None]) -> Callable[[], None]:
        spec = f"suites.mutants:mutant_{name.replace('-', '_')}"
        CATALOGUE[name] = Mutant(name, defect, suite, spec, _lanes(tests, cuda))
        _APPLY[name] = apply
        return apply

    return register


def external(
    name: str,
    *,
    defect: str,
    suite: str,
    tests: tuple[str, ...],
    target: str,
    cuda: tuple[str, ...] | Kill | NotApplicable | None = None,
) -> None:
    """A mutant whose factory lives in a family module (suites/mutants_dit.py, mutants_routing.py)."""
    CATALOGUE[name] = Mutant(name, defect, suite, target, _lanes(tests, cuda))


def _serving_target_with(name: str) -> Any:
    _APPLY[name]()
    from serving_models.target import make_target

    return make_target()


def __getattr__(attribute: str) -> Callable[[], Any]:
    """`mutant_<name>`: the zero-argument --target factory of a registered mutant."""
    if attribute.startswith("mutant_"):
        name = attribute.removeprefix("mutant_").replace("_", "-")
        if name in _APPLY:
            return functools.partial(_serving_target_with, name)
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")


def _patch(module_name: str, attribute: str, replacement: Any) -> None:
    setattr(importlib.import_module(module_name), attribute, replacement)


AR = "serving_models.mammothmoda2_ar"
EXPERT_SELECTION = "suites/test_expert_selection.py"


# ---------------------------------------------------------------------------------------------
# AR backbone (seed 000: vllm-omni#7318, #9764, #9851, #7319, #7432)
# ---------------------------------------------------------------------------------------------


@mutant(
    "multimodal-drops-input-ids",
    defect="the runner's multimodal entry passes inputs_embeds only: mask None, every token on the und expert (#9851)",
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "multimodal and not compiled"),
)
def _drop_input_ids() -> None:
    from serving_models import ar_runner

    original = ar_runner.prepare_model_inputs

    def prepare_model_inputs(model, input_ids, inputs_embeds):
        inputs = original(model, input_ids, inputs_embeds)
        if inputs_embeds is not None:
            inputs["input_ids"] = None
        return inputs

    ar_runner.prepare_model_inputs = prepare_model_inputs


@mutant(
    "host-branch-dispatch-under-capture",
    defect="the eager any/all dispatch stays active under capture, so the dummy batch's branch is what a graph holds (#7318)",
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "test_expert_selection and cpu_graph"),
    cuda=(EXPERT_SELECTION, "-k", "test_expert_selection and cuda_graph"),
)
def _host_branch_dispatch() -> None:
    ar = importlib.import_module(AR)

    def moe_dispatch(hidden_states, und_expert, gen_expert, gen_token_mask, layer_name):
        if gen_expert is None:
            return und_expert(hidden_states)
        return ar.moe_eager(hidden_states, und_expert, gen_expert, gen_token_mask)

    ar.moe_dispatch = moe_dispatch


@mutant(
    "dispatch-from-stale-host-metadata",
    defect=(
        "the expert dispatch branches on host-side batch metadata (has gen tokens / all gen) refreshed only "
        "outside capture: the graph captured after warm-up on the all-zero dummy batch bakes the und expert "
        "and replays it for every real token (vllm-omni#7318 as shipped)"
    ),
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "test_expert_selection and cpu_graph"),
    cuda=(EXPERT_SELECTION, "-k", "test_expert_selection and cuda_graph"),
)
def _stale_host_metadata() -> None:
    import torch

    ar = importlib.import_module(AR)
    from serving_models import capture

    host = {"has_gen": False, "all_gen": False}  # the runner's per-step metadata, kept on the host

    def moe_dispatch(hidden_states, und_expert, gen_expert, gen_token_mask, layer_name):
        if gen_expert is None:
            return und_expert(hidden_states)
        capturing = torch.compiler.is_compiling() or capture.is_capturing(hidden_states.device)
        if gen_token_mask is not None and not capturing:
            mask = gen_token_mask.cpu()  # a host read, legal outside capture: refreshes the metadata
            host.update(has_gen=bool(mask.any()), all_gen=bool(mask.all()))
        if not host["has_gen"]:
            return und_expert(hidden_states)
        if host["all_gen"]:
            return gen_expert(hidden_states)
        return ar.moe_blend(hidden_states, und_expert, gen_expert, gen_token_mask)

    ar.moe_dispatch = moe_dispatch


@mutant(
    "capture-without-mask-fails-open",
    defect="capturing without a mask silently runs the und expert for every token instead of raising (#9764)",
    suite="fail_closed_capture",
    tests=("suites/test_fail_closed_capture.py", "-k", "capture_without_mask"),
)
def _fail_open() -> None:
    ar = importlib.import_module(AR)
    original = ar.moe_dispatch

    def moe_dispatch(hidden_states, und_expert, gen_expert, gen_token_mask, layer_name):
        if gen_token_mask is None:
            return und_expert(hidden_states)
        return original(hidden_states, und_expert, gen_expert, gen_token_mask, layer_name)

    ar.moe_dispatch = moe_dispatch


@mutant(
    "no-clamp-gen-side",
    defect="the gen-table index is id - start unclamped: text ids and the -1 sentinel index out of range on the discarded side (#7432)",
    suite="embedding_clamp",
    tests=("suites/test_embedding_clamp.py", "-k", "in_range_indices and not compiled"),
)
def _no_clamp_gen() -> None:
    _patch(AR, "clamp_gen_ids", lambda input_ids, start, gen_vocab_size: input_ids - start)


@mutant(
    "no-clamp-base-side",
    defect="the base-table index is the raw id: gen ids and the -1 sentinel index out of range on the discarded side (#7319)",
    suite="embedding_clamp",
    tests=("suites/test_embedding_clamp.py", "-k", "in_range_indices and not compiled"),
)
def _no_clamp_base() -> None:
    _patch(AR, "clamp_base_ids", lambda input_ids, base_vocab_size: input_ids)


def _patch_moe_enable(rule: Callable[[int, int, int], bool]) -> None:
    from serving_models import ar_config

    original = ar_config.moe_enable

    def moe_enable(moe_type: str, layer_type: str, layer_idx: int) -> bool:
        if ":" not in moe_type:
            return original(moe_type, layer_type, layer_idx)
        kind, _, span = moe_type.partition("-")
        start, end = (int(v) for v in span.split(":"))
        return layer_type in kind and rule(start, end, layer_idx)

    ar_config.moe_enable = moe_enable


@mutant(
    "moe-range-inclusive",
    defect="moe_type's 'a:b' read as inclusive, enabling the gen expert one layer past the range",
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "moe_type"),
)
def _moe_inclusive() -> None:
    _patch_moe_enable(lambda start, end, i: start <= i <= end)


@mutant(
    "moe-range-shifted",
    defect="moe_type's range shifted by one layer (1-based reading)",
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "moe_type"),
)
def _moe_shifted() -> None:
    _patch_moe_enable(lambda start, end, i: start <= i - 1 < end)


@mutant(
    "gen-mlp-never-called",
    defect="gen_mlp weights load and are never called: every token on the und expert (the 42 unused tensors of #9764)",
    suite="weight_coverage",
    tests=("suites/test_weight_coverage.py", "-k", "target"),
)
def _gen_never_called() -> None:
    _patch(AR, "moe_dispatch", lambda hidden_states, und_expert, gen_expert, gen_token_mask, layer_name: und_expert(hidden_states))


@mutant(
    "decode-resets-mask",
    defect="decode steps drop the mask (UP3's prepare_inputs_for_generation reset misused): decode routes every token to the und expert",
    suite="decode",
    tests=("suites/test_decode.py", "-k", "eager"),
)
def _decode_resets_mask() -> None:
    ar = importlib.import_module(AR)
    lm = ar.MammothModa2Qwen2ForCausalLM
    original = lm.forward

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, gen_token_mask=None, kv_cache=None):
        if kv_cache is not None and input_ids is not None and input_ids.shape[1] == 1:
            inputs_embeds, input_ids = self.get_input_embeddings(input_ids), None
        return original(self, input_ids, positions, intermediate_tensors, inputs_embeds, gen_token_mask, kv_cache)

    lm.forward = forward


def _probe_warning(every_call: bool) -> None:
    from serving_models import capture

    def is_capturing(device) -> bool:
        backend = capture._backend_name(device)
        probe = capture._probes.get(backend)
        if probe is None:
            if every_call:
                warnings.warn(f"backend {backend!r} has no capture probe", capture.MissingCaptureProbeWarning, stacklevel=2)
            return False
        return bool(probe())

    capture.is_capturing = is_capturing


@mutant(
    "probe-warning-every-call",
    defect="the missing-probe warning fires on every call (log spam on NPU/XPU backends)",
    suite="fail_closed_capture",
    tests=("suites/test_fail_closed_capture.py", "-k", "missing_probe"),
)
def _warn_every_call() -> None:
    _probe_warning(every_call=True)


@mutant(
    "probe-warning-never",
    defect="a backend without a capture probe silently reports 'not capturing' (no warning)",
    suite="fail_closed_capture",
    tests=("suites/test_fail_closed_capture.py", "-k", "missing_probe"),
)
def _warn_never() -> None:
    _probe_warning(every_call=False)


@mutant(
    "replay-without-copy-in",
    defect="a decode step replayed without copying the new inputs into the graph's static buffers (stale replay)",
    suite="decode",
    tests=("suites/test_decode.py", "-k", "cpu_graph"),
    cuda=("suites/test_decode.py", "-k", "cuda_graph"),
)
def _no_copy_in() -> None:
    from parity.cpu_graph import CpuGraphRun
    from parity.cuda_graph import CudaGraphRun

    for runner in (CpuGraphRun, CudaGraphRun):
        runner._copy_in = lambda self, inputs: None


@mutant(
    "rmsnorm-eps-1e-5",
    defect="RMSNorm eps 1e-5 (UP25's class default) instead of the release's 1e-6 in the serving model: a small numeric drift",
    suite="numerics",
    tests=("suites/test_numerics_ar.py", "-k", "layer_by_layer and eager"),
    cuda=Kill(
        ("suites/test_numerics_ar.py", "-k", "layer_by_layer and eager"),
        dtype="fp32",
        why=(
            "in bf16 the eps change (1e-5 vs 1e-6 added to mean squares of order 1) moves activations by about "
            "1e-6 relative, far inside bf16 rounding (2^-8): an equivalent mutant at bf16, so the CUDA lane checks it in fp32"
        ),
    ),
)
def _rmsnorm_eps() -> None:
    ar = importlib.import_module(AR)
    original = ar.RMSNorm.__init__

    def __init__(self, hidden_size, eps=1e-6, *args, **kwargs):
        original(self, hidden_size, 1e-5, *args, **kwargs)

    ar.RMSNorm.__init__ = __init__


# ---------------------------------------------------------------------------------------------
# MoE routing (seed 003: ROCm/ATOM#2725, aiter#6916); factories in suites/mutants_routing.py
# ---------------------------------------------------------------------------------------------

external(
    "router-ignores-num-valid-rows",
    defect="the router ignores num_valid_rows: pad rows are dispatched to real experts (vllm#50757)",
    suite="routing",
    tests=("suites/test_routing_edges.py", "-k", "pad-"),
    target="suites.mutants_routing:serving_ignores_valid_rows",
)
external(
    "router-ties-to-highest-id",
    defect="ties broken toward the highest expert id (AITER Triton routing's packed key)",
    suite="routing",
    tests=("suites/test_routing_edges.py", "-k", "tie-"),
    target="suites.mutants_routing:serving_ties_to_highest_id",
)
external(
    "router-reads-count-on-host",
    defect="the router reads the valid-row count on the host: capture fails, or a replay keeps the captured count",
    suite="routing",
    tests=("suites/test_routing_invariance.py", "-k", "replay"),
    target="suites.mutants_routing:serving_count_on_host",
)


# ---------------------------------------------------------------------------------------------
# DiT regional compile (seed 002: vllm-omni#7455) and DiT numerics; factories in suites/mutants_dit.py
# ---------------------------------------------------------------------------------------------

external(
    "dit-repeated-blocks-emptied",
    defect="_repeated_blocks = []: regional compile compiles nothing and runs eager (vllm-omni#7455)",
    suite="recompiles",
    tests=("suites/test_recompiles.py",),
    target="suites.mutants_dit:repeated_blocks_emptied",
)
external(
    "dit-empty-text-skip-in-block",
    defect="the empty-text skip as a block-level `if sequence_length == 0`: CFG's zero-length stream compiles a new graph",
    suite="recompiles",
    tests=("suites/test_recompiles.py",),
    target="suites.mutants_dit:empty_text_skip_in_block",
)
external(
    "dit-context-refiner-on-empty-text",
    defect="no empty-text skip: the context refiner runs on 0 tokens and compiles for them",
    suite="recompiles",
    tests=("suites/test_recompiles.py",),
    target="suites.mutants_dit:context_refiner_on_empty_text",
)
external(
    "dit-rope-theta-from-llm",
    defect="the DiT RoPE built with the LLM's theta (1e6) instead of 10000",
    suite="numerics",
    tests=("suites/test_numerics_dit.py", "-k", "reference"),
    target="suites.mutants_dit:rope_theta_from_llm",
)
external(
    "dit-compiled-rope-rotate-half",
    defect="a compile-only attention path applying RoPE in the rotate-half layout (eager untouched)",
    suite="numerics",
    tests=("suites/test_numerics_dit.py", "-k", "compiled"),
    target="suites.mutants_dit:compiled_rope_rotate_half",
)

"""Resolving `--target`: which implementation the suites run against.

`serving` (the built-in serving-style models) and `reference` (the upstream-faithful models: a
valid, trivially passing run) are names for factories in the model packages; anything else is
`package.module:factory`, a zero-argument callable returning a target object. The plugin resolves
the target once per session, up front (`resolve_target`: one `TargetError` line on any failure),
as soon as a parity test is selected, so `parity/` itself imports no model and a bad `--target`
stops the run before any test. Resolving imports and runs the named module: point it only at code
you trust. A family the target does not provide (`FAMILIES`) has its suites skipped with a reason.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

BUILTIN_TARGETS = {
    "serving": "serving_models.target:make_target",
    "reference": "reference_models.target:make_target",
}


class TargetError(RuntimeError):
    """`--target` names something that cannot be loaded; the message is one line saying what and why."""


def _one_line(exc: BaseException) -> str:
    text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def factory_path(spec: str, option: str = "--target") -> str:
    """`serving` -> `serving_models.target:make_target`; `pkg.mod:fn` is returned unchanged."""
    if spec in BUILTIN_TARGETS:
        return BUILTIN_TARGETS[spec]
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr or not all(part.isidentifier() for part in (*module_name.split("."), attr)):
        raise TargetError(f"{option} {spec!r}: expected one of {', '.join(BUILTIN_TARGETS)} or 'package.module:factory'")
    return spec


def exit_text(exc: SystemExit) -> str:
    """`sys.exit(code)` as a user would have written it, for a line saying who called it."""
    return f"sys.exit({exc.code!r})" if exc.code is not None else "sys.exit()"


def resolve_target(spec: str, option: str = "--target", *, on_step: Callable[[str], None] | None = None, tp: Any = None) -> Any:
    """Import and call the target factory named by `spec` and check what it returned: the object
    is the target. Every failure (no such module, an exception while importing it or in the
    factory, `sys.exit` there, no callable, no `name`) is one `TargetError` line naming the option
    and the spec. Called once per session, up front, by the plugin; note that it runs the named
    module's code. `on_step(what)` is told each step before it starts (`parity check-target`
    names the step a target hung in). `tp`: this rank's place in a tensor-parallel run
    (`parity.plugin.ranks.TensorParallel`), passed as `factory(tp=tp)`; None calls `factory()`."""
    path = factory_path(spec, option)
    module_name, _, attr = path.partition(":")
    where = f"{option} {spec!r}"
    step = on_step or (lambda what: None)
    step(f"importing module {module_name}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetError(f"{where}: cannot import module {module_name!r} ({_one_line(exc)})") from None
    except SystemExit as exc:  # a module that ends the process would end the run with no word (docs/targets.md §1)
        raise TargetError(
            f"{where}: importing module {module_name!r} called {exit_text(exc)}: a target must not end the process"
        ) from None
    except Exception as exc:  # the module's own code raised while importing
        raise TargetError(f"{where}: importing module {module_name!r} raised {_one_line(exc)}") from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        found = "nothing" if factory is None else type(factory).__name__
        raise TargetError(f"{where}: module {module_name!r} has no callable {attr!r} (found {found})")
    if tp is not None and not takes_tp(factory):
        raise TargetError(
            f"{where}: the factory {path} takes no 'tp' argument: a tensor-parallel run (tp {tp.world_size}) calls "
            "factory(tp=...) on every rank (docs/targets.md §11)"
        )
    step(f"calling the factory {path}" + (f" on rank {tp.rank} of {tp.world_size}" if tp is not None else ""))
    try:
        target = factory() if tp is None else factory(tp=tp)
    except SystemExit as exc:
        raise TargetError(f"{where}: the factory {path} called {exit_text(exc)}: a target must not end the process") from None
    except Exception as exc:
        raise TargetError(f"{where}: the factory {path} raised {_one_line(exc)}") from None
    if not isinstance(getattr(target, "name", None), str) or not target.name:
        raise TargetError(f"{where}: the factory returned {type(target).__name__} without a 'name' (expected a non-empty str)")
    return target


def takes_tp(factory: Callable[..., Any]) -> bool:
    """Whether `factory` accepts the keyword `tp` (or any keyword)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return True  # a callable whose signature cannot be read: let the call say
    return any(p.name == "tp" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def load_target(spec: str) -> Any:
    """`resolve_target` under its older name (the rank processes and fork children call it)."""
    return resolve_target(spec)


@dataclass(frozen=True)
class Family:
    """A model family a target may provide: the members that provide it, what a report calls it,
    the suites that need it and its conformance probe ("module:function" of its suites' package:
    the core imports no suite; docs/targets.md §2). Every registry of families reads this record:
    check-target and the run's plan, the suites' ordering (`fixture`), the mutant catalogue's
    groups (`title`), and, keyed by `key`, the model side's release layouts and checkpoint writers."""

    key: str  # the directory of its suites under parity/suites/
    name: str  # short: the check-target lines
    what: str  # in a sentence: "provides no {what}"
    members: tuple[str, ...]
    suites: tuple[str, ...]
    probe: str
    loader: str = ""  # the member that loads it from a checkpoint directory (inspect-checkpoint calls it on both sides)
    fixture: str = ""  # the suites' fixture that builds its models (its tests run together, in this order)
    title: str = ""  # its heading in the mutant catalogue (docs/mutants.md)


FAMILIES: dict[str, Family] = {
    family.key: family
    for family in (
        Family(
            "ar",
            "AR",
            "AR backbone",
            ("load_ar", "build_ar"),
            ("expert_selection", "fail_closed_capture", "embedding_clamp", "numerics", "decode", "weight_coverage", "recompiles"),
            "parity.suites.ar.conformance:probe",
            loader="load_ar",
            fixture="ar_models",
            title="AR backbone",
        ),
        Family(
            "dit",
            "DiT",
            "DiT",
            ("load_dit", "build_dit"),
            ("recompiles", "numerics", "image", "sampler"),
            "parity.suites.dit.conformance:probe",
            loader="load_dit",
            fixture="dit_models",
            title="DiT (model, sampler, decoder)",
        ),
        Family(
            "routing",
            "routing",
            "router",
            ("router",),
            ("routing",),
            "parity.suites.routing.conformance:probe",
            title="MoE routing",
        ),
    )
}


def family_gap(target: Any, family: str) -> str | None:
    """Why `target` cannot run the suites of `family` (a skip reason naming the missing members),
    or None when it provides the family (or the family needs nothing of a target)."""
    if family not in FAMILIES:
        return None
    record = FAMILIES[family]
    missing = [name for name in record.members if not callable(getattr(target, name, None))]
    if not missing:
        return None
    name = getattr(target, "name", type(target).__name__)
    return f"target {name!r} provides no {record.what} (no {', '.join(missing)}): the {family} suites do not apply"


# The report suite of the mutants planted in any target through the contract's surfaces
# (`parity run --mutants`, docs/mutants.md "Your target's score").
PLANTED_SUITE = "target_mutants"

# Suites that need no model family of the target, and why one does not run for a target spec and
# the run's switches (--benchmarks, --mutants) ("" runs).
SUITES_WITHOUT_FAMILY: dict[str, Callable[[str, bool, bool], str]] = {
    "selfcheck": lambda spec, benchmarks, mutants: "",
    "sensitivity": lambda spec, benchmarks, mutants: (
        "" if spec == "serving" else "the mutant catalogue mutates the built-in serving target"
    ),
    "benchmark": lambda spec, benchmarks, mutants: "" if benchmarks else "only with --benchmarks",
    PLANTED_SUITE: lambda spec, benchmarks, mutants: "" if mutants else "only with --mutants",
}


@dataclass(frozen=True)
class SuitePlan:
    """Whether a suite runs for a target: the families whose tests of it run, and those that do not
    with the reason. `parity check-target` prints it and the run selects by it (`not_selected`), so the
    plan and the run cannot differ."""

    suite: str
    runs: tuple[str, ...]  # family keys ("-" for a suite of no family)
    skipped: tuple[tuple[str, str], ...]  # (family key or "-", reason)

    @property
    def ok(self) -> bool:
        return bool(self.runs)


def suite_plan(target: Any, spec: str, *, benchmarks: bool = False, mutants: bool = False) -> list[SuitePlan]:
    """Every report suite, in run order, and which of its families' tests run for `target`."""
    order = list(dict.fromkeys(s for family in FAMILIES.values() for s in family.suites))
    plans = []
    for suite in order:
        runs, skipped = [], []
        for key, family in FAMILIES.items():
            if suite in family.suites:
                gap = family_gap(target, key)
                (skipped.append((key, gap)) if gap else runs.append(key))
        plans.append(SuitePlan(suite, tuple(runs), tuple(skipped)))
    for suite, why in SUITES_WITHOUT_FAMILY.items():
        reason = why(spec, benchmarks, mutants)
        plans.append(SuitePlan(suite, () if reason else ("-",), (("-", reason),) if reason else ()))
    return plans


def not_selected(plans: list[SuitePlan], suite: str | None, family: str | None) -> str | None:
    """Why a test of `suite` under the family directory `family` does not run (None: it runs)."""
    for plan in plans:
        if plan.suite != suite:
            continue
        for key, reason in plan.skipped:
            if key in (family, "-"):
                return reason
    return None


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
    """The AR backbone (docs/targets.md §3 has every member with its shapes and its users).

    `forward` and `forward_multimodal` return an object with attributes `.logits` ([B, L, vocab +
    gen_vocab]) and `.hidden_states` (one [B, L, D] tensor per decoder layer, before the final
    norm): a dataclass or NamedTuple, not a bare tuple. `moe_sites()` gives, per MoE layer, an
    object with `layer, pre_norm, layer_module, und, gen`: the harness observes which expert's
    output a token got through forward hooks on `pre_norm` and `layer_module`. Either the plain
    form (`pre_norm(h) -> x`, `layer_module(...) -> h + moe(x)`) or the fused-residual form of
    serving engines (`pre_norm(hidden, residual) -> (x, h)`, `layer_module(...) -> (moe(x), h)`).

    Optional, for mask-keyed decode graphs (docs/model.md §4): `decode_graph_keys` (the graphs to
    capture per batch size), `select_decode_graph(key)` (host state: what `decode_step` runs and a
    capture bakes; None restores the default) and `decode_graph_key(generating) -> key` (the graph
    a batch replays, from per-row host-side bools). Without them the harness captures one graph."""

    name: str
    config: Any
    module: Any
    moe_layers: tuple[int, ...]
    supports_capture: bool
    capture: CaptureRegistry

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
    whole pipeline (sample with CFG, decode to uint8 RGB). Sizes are latent sizes.

    `timesteps` is the sampler's schedule (`[steps + 1]` float32 times, t_N = 1); `sample` calls
    `module` for every velocity (the sampler suite swaps it for a stand-in), returns the latents
    in the model dtype and takes the negative prompt's states for the unconditional branch (empty
    text without them); docs/model.md §8 has the release's semantics."""

    name: str
    config: Any
    module: Any

    def forward(self, latents: Any, timestep: Any, text_states: Any, text_mask: Any) -> Any: ...
    def block_sites(self) -> list[tuple[str, Any]]: ...
    def timesteps(self, steps: int, height: int, width: int) -> Any: ...
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
        negative_states: Any = None,
        negative_mask: Any = None,
    ) -> Any: ...
    def decode(self, latents: Any) -> Any: ...
    def text_condition(self, length: int, seed: int, batch: int = 1) -> Any: ...


class RouterAdapter(Protocol):
    """The MoE top-k router: `select_experts` returns the pair `(weights fp32 [T, k+S], ids int32
    [T, k+S])`, a plain tuple or a NamedTuple with exactly those fields in that order
    (`router_result_problem`); rows at or past the device-side `num_valid_rows` are -1 / 0."""

    name: str

    def select_experts(self, logits: Any, k: int, **options: Any) -> Any: ...
    def make_experts(self, gate_proj: Any, up_proj: Any, down_proj: Any) -> Any: ...
    def apply_experts(self, x: Any, result: Any, experts: Any) -> Any: ...
    def remap(self, ids: Any, replica_table: Any, row_choice: Any) -> Any: ...
    def expert_load(self, ids: Any, num_valid_rows: Any, num_physical: int) -> Any: ...


ROUTER_RESULT_FIELDS = ("weights", "ids")


def router_result_problem(result: Any) -> str | None:
    """What `result` is when it is not the form docs/targets.md §7 allows for `select_experts` (None
    when it is): the pair `(weights, ids)` in that order, either a plain tuple (as vLLM's
    `select_experts` returns it) or a NamedTuple whose fields are exactly `weights, ids`. The order is what consumers read (fused
    MoE unpacks by position; ROCm/ATOM's swapped pair, docs/routing.md §1): a named result whose
    names disagree with its positions is refused, and the dtypes (fp32 weights, int32 ids) are
    checked beside this, which catches a swapped plain pair. The conformance probe and the routing
    suite's contract row both ask this function, so the two cannot disagree."""
    if not isinstance(result, tuple):
        return f"not a pair (weights, ids) but {type(result).__name__} (return a tuple or a NamedTuple)"
    fields = getattr(result, "_fields", None)
    if fields is not None and tuple(fields) != ROUTER_RESULT_FIELDS:
        return f"a NamedTuple with fields {tuple(fields)}: its fields must be (weights, ids), in that order"
    if len(result) != 2:
        return f"a tuple of {len(result)}, not the pair (weights, ids)"
    return None


# Checks of the AR suites that hold an engine to one way of doing something right (a design
# choice of the built-in target, not a parity property). A target without the policy declares it in
# `Target.not_applicable` = {policy: reason}; the check then writes a `not_applicable` row with that
# reason instead of judging (never a silent pass). docs/targets.md §5.
ENGINE_POLICIES: dict[str, str] = {
    "refusal_wording": (
        "fail_closed_capture: the capture refusal names the layer, offers enforce_eager and says PIECEWISE is "
        "not a workaround (the refusal itself is still checked)"
    ),
    "probe_warning": "fail_closed_capture: a backend without a capture probe warns exactly once, with 'probe' in the text",
    "raw_input_tokens_attribute": (
        "fail_closed_capture: `requires_raw_input_tokens = True` on the module and AR wrapper classes "
        "(the multimodal entry's behaviour is still checked)"
    ),
    "pipeline_parallel_factory": (
        "fail_closed_capture: the module's `make_empty_intermediate_tensors` seeds a bool `gen_token_mask`"
    ),
    "eager_fast_path": (
        "expert_selection: eager on all-und ids runs the und expert only (the captured graph holding both "
        "experts is still checked)"
    ),
}


class Target(Protocol):
    """What `make_target()` returns. A family the target does not implement may be left out:
    the suites of that family then skip with a reason naming the missing member. Optional:
    `not_applicable: Mapping[str, str]`, engine policies (`ENGINE_POLICIES`) the target does not
    follow, each with its reason."""

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

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

import contextlib
import importlib
import inspect
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:  # for the annotations only: resolving a target imports no torch
    from collections.abc import Mapping, Sequence
    from contextlib import AbstractContextManager
    from pathlib import Path

    import torch
    from torch import nn

T = TypeVar("T")

BUILTIN_TARGETS = {
    "serving": "serving_models.target:make_target",
    "reference": "reference_models.target:make_target",
}


class TargetError(RuntimeError):
    """`--target` names something that cannot be loaded; the message is one line saying what and why."""


class ContractBreach(TargetError):
    """The target's own code broke the contract while it was resolved (it ended the process, forked
    it, or handed back a family member that cannot be called): `parity check-target` says the
    target does not conform (exit 1), where a spec that names no factory is exit 3 (docs/cli.md §2)."""


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


def resolve_target(
    spec: str, option: str = "--target", *, on_step: Callable[[str], None] | None = None, tp: Any = None
) -> Target:
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
        raise ContractBreach(
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
    with watching_forks() as forks:
        try:
            target = factory() if tp is None else factory(tp=tp)
        except SystemExit as exc:
            raise ContractBreach(
                f"{where}: the factory {path} called {exit_text(exc)}: a target must not end the process"
            ) from None
        except Exception as exc:
            raise TargetError(f"{where}: the factory {path} raised {_one_line(exc)}") from None
    if forks:
        raise ContractBreach(
            f"{where}: the factory {path} forked this process (os.fork; the copy, pid {forks[0]}, is stopped): a copy that "
            "returns from the factory would run the suites a second time; start an engine's processes with "
            "multiprocessing or subprocess (docs/targets.md §1)"
        )
    if not isinstance(getattr(target, "name", None), str) or not target.name:
        raise TargetError(f"{where}: the factory returned {type(target).__name__} without a 'name' (expected a non-empty str)")
    wrong = uncallable_members(target)
    if wrong:
        member, found = wrong[0]
        raise ContractBreach(
            f"{where}: the target's {member!r} is a {found} object, not a method: the suites call target.{member}(...) "
            "(docs/targets.md §2); leave the member out to leave its family out"
        )
    return target


def uncallable_members(target: Any) -> list[tuple[str, str]]:
    """Family members `target` has but cannot call, with their type (`router` set to the router
    adapter itself instead of a method returning it): without this check the plan would read the
    family as not provided and skip its suites."""
    found = []
    for family in FAMILIES.values():
        for member in family.members:
            value = getattr(target, member, None)
            if value is not None and not callable(value):
                found.append((member, type(value).__name__))
    return found


# ---------------------------------------------------------------------------------------------
# A factory that forks (docs/targets.md §1)
# ---------------------------------------------------------------------------------------------

# While a factory runs: the write end of a pipe each forked copy names itself on, and the count of
# forks the parent saw. A copy knows how it was forked (the frame that called fork); only the
# parent knows it happened, and the copy's line arrives before it does anything else.
_FORK_PIPE: int | None = None
_FORKS_SEEN = [0]
_CHILD_ONLY_FORKERS = ("multiprocessing", "subprocess", "concurrent.futures")  # the copy never returns into the caller


def _after_fork_in_parent() -> None:
    if _FORK_PIPE is not None:
        _FORKS_SEEN[0] += 1


def _after_fork_in_child() -> None:
    global _FORK_PIPE
    if _FORK_PIPE is None:
        return
    caller = sys._getframe(1).f_globals.get("__name__", "") if sys._getframe(1) is not None else ""
    kind = "spawner" if str(caller).startswith(_CHILD_ONLY_FORKERS) else "copy"
    with contextlib.suppress(OSError):
        os.write(_FORK_PIPE, f"{os.getpid()} {kind}\n".encode())
        os.close(_FORK_PIPE)
    _FORK_PIPE = None  # its own forks are its business


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def watching_forks() -> Iterator[list[int]]:
    """Around a call of target code: the list it yields gets the process ids of the copies the call
    forked with a plain `os.fork` (a multiprocessing worker or a subprocess is no copy: neither
    returns into the caller); those copies are killed. A copy that returns anyway ends at once
    (`os._exit`), so no second copy of the harness runs the suites."""
    global _FORK_PIPE
    if not hasattr(os, "register_at_fork") or _FORK_PIPE is not None:
        yield []
        return
    me = os.getpid()
    read_end, write_end = os.pipe()
    _FORK_PIPE, _FORKS_SEEN[0] = write_end, 0
    copies: list[int] = []
    try:
        yield copies
    finally:
        if os.getpid() != me:  # a copy returning from the target's fork
            os._exit(1)
        _FORK_PIPE = None
        os.close(write_end)
        seen, lines = _FORKS_SEEN[0], b""
        while lines.count(b"\n") < seen:  # each copy writes its line first thing after the fork
            chunk = os.read(read_end, 4096)
            if not chunk:
                break
            lines += chunk
        os.close(read_end)
        for line in lines.decode().splitlines():
            pid, _, kind = line.partition(" ")
            if kind == "copy":
                copies.append(int(pid))
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
                    os.waitpid(int(pid), 0)


def takes_tp(factory: Callable[..., Any]) -> bool:
    """Whether `factory` accepts the keyword `tp` (or any keyword)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return True  # a callable whose signature cannot be read: let the call say
    return any(p.name == "tp" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


@dataclass(frozen=True)
class Family:
    """A model family a target may provide: the members that provide it, what a report calls it,
    the suites that need it and its conformance probe ("module:function" of its suites' package:
    the core imports no suite; docs/targets.md §2). Every list of families derives from this record:
    check-target and the run's plan, the suites' ordering and model fixtures (`fixture`), the
    conformance probes' loaders (`loader`, `builder`), the mutant catalogue's groups (`title`), the
    case files (`case_file`), the stage vocabularies (`vocabulary`), the review page's per-site
    plots (`sites`, `plot_title`) and make-checkpoint's kinds (`loader`); the model side's release
    layouts and checkpoint makers and writers are keyed by `key` (tests/repo/test_families.py
    holds every list to this record; CONTRIBUTING.md "Add a model family")."""

    key: str  # the directory of its suites under parity/suites/
    name: str  # short: the check-target lines
    what: str  # in a sentence: "provides no {what}"
    members: tuple[str, ...]
    suites: tuple[str, ...]
    probe: str
    loader: str = ""  # the member that loads it from a checkpoint directory (inspect-checkpoint calls it on both sides)
    builder: str = ""  # the member that builds it from a config and a state dict (the conformance probe calls both)
    fixture: str = ""  # the suites' fixture that builds its models (its tests run together, in this order)
    title: str = ""  # its heading in the mutant catalogue (docs/mutants.md)
    case_file: str = ""  # its case table under cases/, the one its suites' tests read
    vocabulary: str = ""  # "module:attribute" of its stage vocabulary (docs/localise.md §2)
    sites: tuple[str, ...] = ()  # the `site` values its per-site rows carry: "layer." a prefix, "logits" a name
    plot_title: str = ""  # the review page's plot of those sites, one x axis (docs/reports.md)


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
            builder="build_ar",
            fixture="ar_models",
            title="AR backbone",
            case_file="ar.toml",
            vocabulary="parity.localise.families.ar:VOCABULARY",
            sites=("layer.", "logits", "embed", "embeddings"),
            plot_title="AR decoder: error by layer",
        ),
        Family(
            "dit",
            "DiT",
            "DiT",
            ("load_dit", "build_dit"),
            ("recompiles", "numerics", "image", "sampler"),
            "parity.suites.dit.conformance:probe",
            loader="load_dit",
            builder="build_dit",
            fixture="dit_models",
            title="DiT (model, sampler, decoder)",
            case_file="dit.toml",
            vocabulary="parity.localise.families.dit:VOCABULARY",
            sites=("block.", "velocity"),
            plot_title="DiT: error by block",
        ),
        Family(
            "routing",
            "routing",
            "router",
            ("router",),
            ("routing",),
            "parity.suites.routing.conformance:probe",
            title="MoE routing",
            case_file="routing.toml",
            vocabulary="parity.localise.families.routing:VOCABULARY",
        ),
    )
}


def family_gap(target: object, family: str) -> str | None:
    """Why `target` cannot run the suites of `family` (a skip reason naming the missing members),
    or None when it provides the family (or the family needs nothing of a target)."""
    missing = family_missing(target, family)
    if not missing:
        return None
    name = getattr(target, "name", type(target).__name__)
    return f"target {name!r} provides no {FAMILIES[family].what} (no {', '.join(missing)}): the {family} suites do not apply"


def family_missing(target: object, family: str) -> list[str]:
    """The members of `family` that `target` lacks ([] when it provides the family, or for a key
    that is not a family)."""
    if family not in FAMILIES:
        return []
    return [name for name in FAMILIES[family].members if not callable(getattr(target, name, None))]


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


# The directory under parity/suites/ that holds each suite of no family (a family's suites live in its key's).
SUITE_DIRECTORIES = {"selfcheck": "selfcheck", "sensitivity": "sensitivity", "benchmark": "benchmarks"}


def suite_families() -> dict[str, frozenset[str]]:
    """For each report suite, the suites' directories whose tests write it (the `family` column of
    its rows: `numerics` is `ar` or `dit`, `routing` only `routing`). A review checks a baseline's
    family column against it (`parity.report.baseline.misplaced_family`)."""
    found: dict[str, set[str]] = {}
    for key, family in FAMILIES.items():
        for suite in family.suites:
            found.setdefault(suite, set()).add(key)
    for suite, directory in SUITE_DIRECTORIES.items():
        found.setdefault(suite, set()).add(directory)
    return {suite: frozenset(keys) for suite, keys in found.items()}


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
# Data members are read-only properties, so an adapter may hold them as attributes of a narrower
# type or compute them; a type checker holds an adapter to its Protocol (`x: type[ARAdapter] =
# MyAdapter`, as examples/ does).
# ---------------------------------------------------------------------------------------------


class CaptureRegistry(Protocol):
    """The target-owned capture-probe registry (see `serving_models/common/capture.py`)."""

    def register_capture_probe(self, backend: str, probe: Callable[[], bool] | None) -> Callable[[], bool] | None: ...
    def capture_probe(self, backend: str, probe: Callable[[], bool] | None) -> AbstractContextManager[object]: ...
    def is_capturing(self, device: torch.device | str) -> bool: ...


class AROutput(Protocol):
    """What `forward` and `forward_multimodal` return: a dataclass or NamedTuple with these fields."""

    @property
    def logits(self) -> torch.Tensor: ...  # [B, L, vocab + gen_vocab]
    @property
    def hidden_states(self) -> Sequence[torch.Tensor]: ...  # one [B, L, D] per decoder layer, before the final norm


class GenerateOutput(Protocol):
    """What `greedy_generate` returns: `step_logits[:, i]` chose `tokens[:, i]`."""

    @property
    def tokens(self) -> torch.Tensor: ...  # [B, N]
    @property
    def step_logits(self) -> torch.Tensor: ...  # [B, N, V]


class MoESite(Protocol):
    """One MoE layer's observation points (docs/targets.md §4)."""

    @property
    def layer(self) -> int: ...
    @property
    def pre_norm(self) -> nn.Module: ...
    @property
    def layer_module(self) -> nn.Module: ...
    @property
    def und(self) -> Callable[[torch.Tensor], torch.Tensor]: ...
    @property
    def gen(self) -> Callable[[torch.Tensor], torch.Tensor]: ...


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

    @property
    def name(self) -> str: ...
    @property
    def config(self) -> object: ...  # the target's own (docs/targets.md §3): the suites read the reference's
    @property
    def module(self) -> nn.Module: ...
    @property
    def moe_layers(self) -> tuple[int, ...]: ...
    @property
    def supports_capture(self) -> bool: ...
    @property
    def capture(self) -> CaptureRegistry: ...

    def moe_sites(self) -> Sequence[MoESite]: ...
    def embedding_modules(self) -> tuple[nn.Module, nn.Module]: ...
    def weight_name_map(self) -> Mapping[str, Sequence[str]]: ...
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        gen_token_mask: torch.Tensor | None = None,
    ) -> AROutput: ...
    def forward_multimodal(self, inputs_embeds: torch.Tensor, input_ids: torch.Tensor) -> AROutput: ...
    def allocate_decode_state(self, batch: int, max_len: int) -> object: ...  # the target's own KV cache
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...
    def greedy_generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        step_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> GenerateOutput: ...


class DiTConfig(Protocol):
    """The DiT config's field the suites read (latent channels)."""

    @property
    def in_channels(self) -> int: ...


class DiTAdapter(Protocol):
    """The DiT stage: velocity of one denoising step, block sites in execution order, and the
    whole pipeline (sample with CFG, decode to uint8 RGB). Sizes are latent sizes.

    `timesteps` is the sampler's schedule (`[steps + 1]` float32 times, t_N = 1); `sample` calls
    `module` for every velocity (the sampler suite swaps it for a stand-in), returns the latents
    in the model dtype and takes the negative prompt's states for the unconditional branch (empty
    text without them); docs/model.md §8 has the release's semantics."""

    @property
    def name(self) -> str: ...
    @property
    def config(self) -> DiTConfig: ...
    @property
    def module(self) -> nn.Module: ...

    def forward(
        self, latents: torch.Tensor, timestep: torch.Tensor, text_states: torch.Tensor, text_mask: torch.Tensor
    ) -> torch.Tensor: ...
    def block_sites(self) -> Sequence[tuple[str, nn.Module]]: ...
    def timesteps(self, steps: int, height: int, width: int) -> torch.Tensor: ...
    def sample(
        self,
        text_states: torch.Tensor,
        text_mask: torch.Tensor,
        height: int,
        width: int,
        steps: int,
        guidance_scale: float,
        cfg_range: tuple[float, float] = ...,
        seed: int = 0,
        negative_states: torch.Tensor | None = None,
        negative_mask: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...  # uint8 RGB
    def text_condition(self, length: int, seed: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]: ...


class RouterAdapter(Protocol):
    """The MoE top-k router: `select_experts` returns the pair `(weights fp32 [T, k+S], ids int32
    [T, k+S])`, a plain tuple or a NamedTuple with exactly those fields in that order
    (`router_result_problem`); rows at or past the device-side `num_valid_rows` are -1 / 0."""

    @property
    def name(self) -> str: ...

    # `options`: the keywords of docs/targets.md §7 (str, int, float and tensor values alike)
    def select_experts(self, logits: torch.Tensor, k: int, **options: Any) -> tuple[torch.Tensor, torch.Tensor]: ...
    # `experts` is whatever the target's own `make_experts` returned: its type is the target's
    def make_experts(self, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor) -> Any: ...
    def apply_experts(self, x: torch.Tensor, result: tuple[torch.Tensor, torch.Tensor], experts: Any) -> torch.Tensor: ...
    def remap(self, ids: torch.Tensor, replica_table: torch.Tensor, row_choice: torch.Tensor) -> torch.Tensor: ...
    def expert_load(self, ids: torch.Tensor, num_valid_rows: torch.Tensor | None, num_physical: int) -> torch.Tensor: ...


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

    @property
    def name(self) -> str: ...
    @property
    def capture(self) -> CaptureRegistry: ...

    # `config` of the build members is the model side's config object (the reference's), whose
    # type the harness does not know: a target takes its own
    def load_ar(self, checkpoint_dir: str | Path, device: torch.device | str, dtype: torch.dtype) -> ARAdapter: ...
    def build_ar(
        self, config: Any, state_dict: Mapping[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype
    ) -> ARAdapter: ...
    def load_dit(self, checkpoint_dir: str | Path, device: torch.device | str, dtype: torch.dtype) -> DiTAdapter: ...
    def build_dit(
        self, config: Any, state_dict: Mapping[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype
    ) -> DiTAdapter: ...
    def router(self) -> RouterAdapter: ...


def missing_members(obj: object, protocol: type) -> list[str]:
    """Members of `protocol` that `obj` lacks (attributes, properties and methods), in declaration order."""
    names = list(getattr(protocol, "__annotations__", {}))
    names += [n for n, v in vars(protocol).items() if (callable(v) or isinstance(v, property)) and not n.startswith("_")]
    return [n for n in dict.fromkeys(names) if not hasattr(obj, n)]


def require(obj: T, protocol: type, what: str) -> T:
    """Return `obj` if it has every member of `protocol`, else raise a TargetError naming the gaps."""
    missing = missing_members(obj, protocol)
    if missing:
        raise TargetError(f"{what} ({type(obj).__name__}) lacks {protocol.__name__} members: {', '.join(missing)}")
    return obj

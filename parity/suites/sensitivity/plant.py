"""Planting a defect in any target through the surfaces the contract already has.

The built-in catalogue (`catalogue.py`) patches the built-in target's code; an engine's own code
is out of parity's reach. A *planted* mutant needs none of it: `PlantedTarget` wraps the target a
run was given and changes only what crosses the contract (docs/targets.md) on its way in or out:

* **checkpoint**: the directory handed to `load_*` is replaced by a transformed copy (a state
  dict handed to `build_*` by a transformed dict), with the reference's tensor names (parity's
  layout or the release's, docs/checkpoints.md);
* **config**: a field of `config.json` (or of the config object `build_*` receives) changed;
* **capture**: the target's probe registry replaced by one that drops the harness's probes, so
  the model is never told it is being captured;
* **calls**: an adapter's member called with other arguments (the positions of `decode_step`, the
  router's `num_valid_rows`).

The reference and the golden still load the untouched checkpoint, so every suite judges the
mutated target against the truth. A mutant that changes nothing on a given target (the checkpoint
has no such tensor, the target does not take that config field) raises `Equivalent`; in a session
the wrapper turns it into a skip of every test, and the score records the mutant `not_applicable`
with the reason, never as killed.

A planted mutant is a `--target` factory, `parity.suites.sensitivity.planted:mutant_<name with _
for ->`, that wraps the target named by `$PARITY_PLANTED_ON` (the run's own `--target`; the
variable reaches every process a session starts: its tensor-parallel ranks, the routing suite's
spawned ranks). The entries are in `planted.py`; docs/mutants.md, "Your target's score", lists them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from parity.compare import ERROR, NOT_APPLICABLE, Verdict, better_of, flag_rule
from parity.suites.sensitivity.catalogue import LANES, Kill, NotApplicable, lane_of
from parity.target import FAMILIES, TargetError, family_gap, resolve_target

PLANTED_ON_ENV = "PARITY_PLANTED_ON"
SURFACES = ("checkpoint", "config", "capture", "calls")
# The words a wrapper's skip starts with: the score reads an all-skipped selection as not applicable.
EQUIVALENT = "planted mutant equivalent on this target"

Tensors = dict[str, Any]  # parity (upstream) tensor name -> tensor


class Equivalent(Exception):
    """The mutant changes nothing on this target or checkpoint; the message says why."""


class PlantingError(RuntimeError):
    """Planting the mutant itself failed (not the target): its session's errors kill nothing."""


@dataclasses.dataclass(frozen=True)
class Planted:
    """One target-level mutant: what it plants, through which surface, and who must kill it."""

    name: str
    defect: str  # the defect it stands for
    surface: str  # one of SURFACES
    family: str  # the model family it plants into (parity.target.FAMILIES)
    suite: str  # the report suite that must kill it
    lanes: Mapping[str, Kill | NotApplicable]
    equivalent_when: str  # when it is equivalent on a target (reported not applicable then), in words
    # Exactly one change. `tensors(state, config)` replaces entries of `state` (parity names; never
    # writes into a tensor: a `build_*` caller may share them with the reference); `config(config)`
    # gives the fields to change and their new values; `adapter` / `router` wrap what the target
    # returns; `capture` replaces the probe registry.
    tensors: Callable[[Tensors, Any], None] | None = None
    config: Callable[[Any], dict[str, Any]] | None = None
    adapter: Callable[[Any], Any] | None = None
    router: Callable[[Any], Any] | None = None
    capture: bool = False

    @property
    def target(self) -> str:
        """The `--target` factory that loads the mutant (around `$PARITY_PLANTED_ON`)."""
        return f"parity.suites.sensitivity.planted:mutant_{self.name.replace('-', '_')}"

    def on(self, lane: str) -> Kill | NotApplicable:
        return self.lanes[lane]


PLANTED: dict[str, Planted] = {}


def register(entry: Planted) -> Planted:
    changes = [entry.tensors, entry.config, entry.adapter, entry.router, entry.capture or None]
    if sum(change is not None for change in changes) != 1:
        raise ValueError(f"planted mutant {entry.name!r}: exactly one change (tensors, config, adapter, router or capture)")
    if entry.surface not in SURFACES or entry.family not in FAMILIES or set(entry.lanes) != set(LANES):
        raise ValueError(
            f"planted mutant {entry.name!r}: surface {entry.surface!r}, family {entry.family!r}, lanes {sorted(entry.lanes)}"
        )
    PLANTED[entry.name] = entry
    return entry


# ---------------------------------------------------------------------------------------------
# When a mutant applies: the target's families, the lane, and the change itself
# ---------------------------------------------------------------------------------------------


def provided_families(target: Any) -> frozenset[str]:
    """The model families `target` provides (the keys of `parity.target.FAMILIES`)."""
    return frozenset(key for key in FAMILIES if family_gap(target, key) is None)


def not_applicable(entry: Planted, lane: str, families: frozenset[str]) -> str | None:
    """Why `entry` cannot show on this run before any session (None: run it): a family the target
    does not provide, a lane where it is equivalent, or a change that finds nothing to change in
    the family's checkpoint."""
    if entry.family not in families:
        return f"the target provides no {FAMILIES[entry.family].what}, where this mutant is planted"
    kill = entry.on(lane)
    if isinstance(kill, NotApplicable):
        return f"not applicable on the {lane} lane: {kill.reason}"
    if entry.tensors is not None or entry.config is not None:
        state, config = reference_checkpoint(entry.family, kill.size)
        try:
            if entry.tensors is not None:
                entry.tensors(dict(state), config)
            else:
                entry.config(config)
        except Equivalent as why:
            return f"equivalent on this checkpoint: {why}"
    return None


@functools.lru_cache(maxsize=4)
def reference_checkpoint(family: str, size: str) -> tuple[Tensors, Any]:
    """The family's checkpoint as the suites draw it, on the meta device (only names, shapes and
    the config matter to the rules, whatever the seed), with its config."""
    import torch

    if family == "ar":
        from reference_models.ar.config import ar_config
        from reference_models.ar.model import MammothModa2ForCausalLM

        config = ar_config(size)
        with torch.device("meta"):
            return dict(MammothModa2ForCausalLM(config).state_dict()), config
    if family == "dit":
        from reference_models.dit.checkpoint import expected_shapes
        from reference_models.dit.config import config_for_size

        config = config_for_size(size)
        return {name: torch.empty(shape, device="meta") for name, shape in expected_shapes(config).items()}, config
    return {}, None


# ---------------------------------------------------------------------------------------------
# Checkpoints and configs
# ---------------------------------------------------------------------------------------------


def _stored_names(family: str, names: list[str], release: bool) -> dict[str, str]:
    """parity name -> the name stored in the directory (the release's prefixed names, docs/checkpoints.md §2)."""
    if not release:
        return {name: name for name in names}
    if family != "ar":
        raise Equivalent(f"a {family} checkpoint in the release layout: planted {family} mutants read parity's layout")
    from reference_models.ar.release import AR_RULES

    found = {}
    for name in names:
        rule = next((rule for rule in AR_RULES if name.startswith(rule.release)), None)
        if rule is not None and rule.local is not None:
            found[rule.local + name[len(rule.release) :]] = name
    return found


def _config_object(family: str, directory: Path) -> Any:
    if family == "ar":
        from reference_models.ar.config import MammothModa2ARConfig

        return MammothModa2ARConfig.from_pretrained(directory)
    return None


def set_config_field(data: dict[str, Any], field: str, value: Any) -> Any:
    """Set `field` wherever `config.json` holds it (flat, or nested as the release nests it);
    returns the old value. A config that does not hold it cannot be planted (`Equivalent`)."""
    holders = [data] if field in data else []
    stack = [v for v in data.values() if isinstance(v, dict)]
    while stack:
        node = stack.pop()
        if field in node:
            holders.append(node)
        stack += [v for v in node.values() if isinstance(v, dict)]
    if not holders:
        raise Equivalent(f"config.json holds no {field!r} (the target takes its default)")
    old = holders[0][field]
    for holder in holders:
        holder[field] = value
    return old


def planted_directory(entry: Planted, directory: str | Path) -> tuple[Path, dict[str, tuple[Any, Any]]]:
    """A transformed copy of the checkpoint `directory` beside it, and the config fields changed
    (field -> (old, new)). Every file but the weights and config.json is copied as it is."""
    from reference_models.common import hf_checkpoint
    from reference_models.common.release_layout import CONFIG_FILE, is_release_config, read_config_json

    source = Path(directory)
    data = read_config_json(source)
    config = _config_object(entry.family, source)
    tensors = hf_checkpoint.load_state_dict(source)
    changed: dict[str, tuple[Any, Any]] = {}
    if entry.tensors is not None:
        stored = _stored_names(entry.family, list(tensors), is_release_config(data))
        view = {name: tensors[where] for name, where in stored.items()}
        entry.tensors(view, config)
        tensors.update({stored[name]: tensor for name, tensor in view.items() if name in stored})
    if entry.config is not None:
        for field, value in entry.config(config).items():
            changed[field] = (set_config_field(data, field, value), value)
    out = Path(tempfile.mkdtemp(prefix=f"{source.name}-planted-{entry.name}-", dir=source.parent))
    weights = {p.name for p in source.iterdir() if p.name.endswith((".safetensors", ".safetensors.index.json"))}
    for path in source.iterdir():
        if path.is_file() and path.name not in weights and path.name != CONFIG_FILE:
            shutil.copy2(path, out / path.name)
    hf_checkpoint.save_state_dict(out, tensors)
    (out / CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")
    return out, changed


def replace_config(config: Any, changes: Mapping[str, Any]) -> Any:
    """`config` with `changes` (a dataclass is replaced, any other object copied)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.replace(config, **changes)
    changed = copy.copy(config)
    for field, value in changes.items():
        setattr(changed, field, value)
    return changed


# ---------------------------------------------------------------------------------------------
# The wrapped target
# ---------------------------------------------------------------------------------------------


class DroppedProbes:
    """A capture-probe registry that takes the harness's probes and never hands them to the model:
    the model keeps asking its own registry, which never hears that a capture started."""

    def register_capture_probe(self, backend: str, probe: Callable[[], bool] | None) -> None:
        return None

    @contextlib.contextmanager
    def capture_probe(self, backend: str, probe: Callable[[], bool] | None) -> Iterator[None]:
        yield

    def is_capturing(self, device: Any) -> bool:
        return False


class Proxy:
    """An adapter as the target returned it, every member passed through but the ones a subclass
    overrides (a call planted on its way in)."""

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


def _skip_equivalent(entry: Planted, why: object) -> None:
    pytest.skip(f"{EQUIVALENT} ({entry.name}): {why}")


class PlantedTarget:
    """`inner` with one planted mutant; only the members `inner` has (a family it leaves out stays
    left out)."""

    LOADERS = {"load_ar": "ar", "load_dit": "dit"}
    BUILDERS = {"build_ar": "ar", "build_dit": "dit"}

    def __init__(self, inner: Any, entry: Planted) -> None:
        self._inner, self._entry = inner, entry
        self.name = f"{inner.name}+{entry.name}"

    @property
    def capture(self) -> Any:
        return DroppedProbes() if self._entry.capture else self._inner.capture

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        member = getattr(self._inner, name)
        if name in self.LOADERS:
            return functools.partial(self._load, self.LOADERS[name], member)
        if name in self.BUILDERS:
            return functools.partial(self._build, self.BUILDERS[name], member)
        if name == "router" and self._entry.router is not None:
            return lambda: self._entry.router(member())
        return member

    def _load(self, family: str, loader: Callable[..., Any], directory: Any, device: Any, dtype: Any) -> Any:
        changed: dict[str, tuple[Any, Any]] = {}
        if family == self._entry.family and (self._entry.tensors or self._entry.config):
            with self._planting():
                directory, changed = planted_directory(self._entry, directory)
        return self._finish(family, loader(directory, device, dtype), changed)

    @contextlib.contextmanager
    def _planting(self) -> Iterator[None]:
        """An `Equivalent` change skips the session's tests; any other failure of the planting is
        a `PlantingError`, which the score never counts as a kill."""
        try:
            yield
        except Equivalent as why:
            _skip_equivalent(self._entry, why)
        except Exception as exc:
            raise PlantingError(f"planting {self._entry.name} failed: {type(exc).__name__}: {exc}") from exc

    def _build(self, family: str, builder: Callable[..., Any], config: Any, state_dict: Any, device: Any, dtype: Any) -> Any:
        changed: dict[str, tuple[Any, Any]] = {}
        if family == self._entry.family:
            with self._planting():
                if self._entry.tensors is not None:
                    state_dict = dict(state_dict)
                    self._entry.tensors(state_dict, config)
                if self._entry.config is not None:
                    changes = self._entry.config(config)
                    changed = {field: (getattr(config, field, None), value) for field, value in changes.items()}
                    config = replace_config(config, changes)
        return self._finish(family, builder(config, state_dict, device, dtype), changed)

    def _finish(self, family: str, adapter: Any, changed: Mapping[str, tuple[Any, Any]]) -> Any:
        """A config field the adapter's config still reports at its old value was not taken from
        the config: equivalent on this target (docs/mutants.md, "Your target's score")."""
        held = getattr(adapter, "config", None)
        for field, (old, new) in changed.items():
            if hasattr(held, field) and getattr(held, field) == old != new:
                _skip_equivalent(
                    self._entry,
                    f"the target's config keeps {field}={old!r} when given {new!r}: it does not take it from its config",
                )
        if family == "ar" and self._entry.adapter is not None:
            return self._entry.adapter(adapter)
        return adapter


def planted_target(name: str, tp: Any = None) -> PlantedTarget:
    """The factory of planted mutant `name`: the target of `$PARITY_PLANTED_ON`, wrapped."""
    spec = os.environ.get(PLANTED_ON_ENV, "")
    if not spec:
        raise TargetError(
            f"planted mutant {name!r} wraps the target named by ${PLANTED_ON_ENV} (the run's --target), which is not set"
        )
    return PlantedTarget(resolve_target(spec, option=f"${PLANTED_ON_ENV}", tp=tp), PLANTED[name])


def factory_lookup(module: str) -> Callable[[str], Callable[..., PlantedTarget]]:
    """A module `__getattr__` serving `mutant_<name>` for every planted mutant."""

    def __getattr__(attribute: str) -> Callable[..., PlantedTarget]:
        name = attribute.removeprefix("mutant_").replace("_", "-")
        if attribute.startswith("mutant_") and name in PLANTED:
            return functools.partial(planted_target, name)
        raise AttributeError(f"module {module!r} has no attribute {attribute!r}")

    return __getattr__


# ---------------------------------------------------------------------------------------------
# The verdict of one mutant's session
# ---------------------------------------------------------------------------------------------


def kill_verdict(entry: Planted, code: int, rows: pd.DataFrame | None, tail: str, where: str) -> Verdict:
    """Killed: the session failed with a failing gate row of the mutant's suite. Not applicable:
    the session passed and every test of the mutant's suite in it skipped (the wrapper found the
    mutant equivalent on this target, or the suite has nothing to run on it), with the reasons.
    Anything else survived, with what the session said."""
    rows = rows if rows is not None else pd.DataFrame(columns=["suite", "kind", "verdict", "metric", "detail"])
    mine = rows[rows["suite"] == entry.suite]
    gates = mine[mine["kind"] == "gate"]
    killers = gates[gates["verdict"].isin(["fail", "error"])]
    unplanted = killers["detail"].astype(str).str.contains(PlantingError.__name__, regex=False)
    if not killers.empty and unplanted.all():
        return Verdict(
            ERROR,
            "killed",
            None,
            None,
            f"{entry.defect} || could not be planted on the {where}: {str(killers.iloc[0]['detail'])[:300]}",
            better=better_of("killed"),
        )
    killers = killers[~unplanted]
    if code != 0 and not killers.empty:
        first = killers.iloc[0]
        return flag_rule(
            True,
            metric="killed",
            detail=f"{entry.defect} || killed on the {where} by {first['suite']}/{first['case']}/{first['mode']} "
            f"{first['metric']}={first['value']}: {str(first['detail'])[:300]}",
        )
    skipped = mine[mine["metric"] == "skipped"]
    if code == 0 and gates.empty and not skipped.empty:
        reasons = "; ".join(dict.fromkeys(str(reason) for reason in skipped["detail"]))
        return Verdict(
            NOT_APPLICABLE,
            "killed",
            None,
            None,
            f"{entry.defect} || not applicable on this target: every {entry.suite} test of its selection skipped: {reasons[:400]}",
            better=better_of("killed"),
        )
    return flag_rule(
        False,
        metric="killed",
        detail=f"{entry.defect} || SURVIVED on the {where}: exit {code}, no failing {entry.suite} row ({tail[:300]}); "
        f"equivalent only when {entry.equivalent_when}",
    )


def lane_kill(entry: Planted, device: str, tp: int) -> Kill | NotApplicable:
    """The mutant's selection on the lane of `device`, at the run's tensor-parallel size (a planted
    mutant is planted before sharding: its selection runs at whatever size the target runs)."""
    kill = entry.on(lane_of(device))
    return dataclasses.replace(kill, tp=tp) if isinstance(kill, Kill) else kill


# ---------------------------------------------------------------------------------------------
# docs/mutants.md, "Your target's score" (generated with the rest of the page: catalogue.markdown)
# ---------------------------------------------------------------------------------------------

MARKDOWN_SECTION = """## Your target's score

The catalogue above patches the built-in target's code: it proves the suites on parity's own port.
To prove them on *your* port, `parity run --target SPEC --mutants` (pytest: `--parity-mutants`)
plants the mutants below in your target after the suites, and prints

```
mutation score on <your target's name>: K/N applicable target-level mutants killed (<suite> k/n, ...)
```

with a `target_mutants` row per mutant in `results.csv` (case the mutant, mode the suite that
must kill it, site the surface) and a section on the review page. Nothing of your code is touched:
each mutant is planted through a surface the contract already has (`parity/suites/sensitivity/plant.py`):

| surface | how it is planted |
|---|---|
| `checkpoint` | `load_*` gets a transformed copy of the checkpoint directory (the release layout's names too), `build_*` a transformed state dict; the reference and the golden load the untouched one |
| `config` | a field of `config.json` (flat or nested), or of the config object `build_*` gets, changed |
| `capture` | your target's `capture` replaced by a registry that takes the harness's probes and never hands them to your model |
| `calls` | an adapter member called with other arguments: `decode_step`'s positions, the router's keywords |

Each mutant's tests (the cpu lane's selection below) run against your target with it planted, in
an isolated session batched with the others on the built-in catalogue's fork server. **Killed**: a
gate row of the named suite failed. **Not applicable** (counted neither way, with its reason): a
family your target does not provide, a lane where the mutant is equivalent, a checkpoint or config
without what it changes, a config field your adapter's `config` still reports at its old value (your
target does not take it), or a selection whose every test skips on your target (`supports_capture
= False` skips the capture mutant). Your unmutated target runs the same selections under seeds 1,
2 and 3 and must raise no alarm (`unmutated-target-seed-N` rows), so a kill is never a test that
fails anyway.

**Reading a survivor.** A survivor is a defect of that kind your port could ship past the suites.
Its row says what the session did (exit status, the last lines of its log) and the mutant's
equivalence rule. Run it by hand to see its rows:

```bash
PARITY_PLANTED_ON=SPEC pytest <its cpu-lane selection> --parity-target parity.suites.sensitivity.planted:mutant_<name with _ for ->
```

Either the named suite cannot see the defect on your target (its tests skip or judge something your
adapter computes differently: look at which rows it wrote), and the gap is the suites' to close; or
the mutant is equivalent on your target in a way its rule does not know (a model that hard-codes a
value, a capture your model detects by itself on the CPU too), and the survivor stands with that
reason until the rule learns it.

**How long.** Well under one suites session of your target: on 2 shared cores the minimal
target's `parity run --mutants` took 69 s (warm) to 132 s (cold) more than its suites alone, the
sessions running beside the suites on the second core; docs/performance.md §1.
"""


def markdown() -> str:
    """The section: how the score is made and read, and every planted mutant."""
    lines = [MARKDOWN_SECTION]
    per_suite: dict[str, int] = {}
    for entry in PLANTED.values():
        per_suite[entry.suite] = per_suite.get(entry.suite, 0) + 1
    counts = ", ".join(f"`{suite}` {n}" for suite, n in sorted(per_suite.items()))
    lines.append(f"{len(PLANTED)} planted mutants. Killed by suite: {counts}.\n")
    lines.append("| mutant | surface | defect | killed by | equivalent when | cpu lane | cuda lane |")
    lines.append("|---|---|---|---|---|---|---|")
    from parity.suites.sensitivity.catalogue import _cell, _selection

    for entry in PLANTED.values():
        cells = (
            f"`{entry.name}`",
            f"{entry.surface} ({FAMILIES[entry.family].name})",
            entry.defect,
            f"`{entry.suite}`",
            entry.equivalent_when,
            _selection(entry.on("cpu")),
            _selection(entry.on("cuda")),
        )
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"

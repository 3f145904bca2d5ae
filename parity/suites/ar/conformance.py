"""The AR family's conformance probe: every `ARAdapter` member on a tiny input (docs/targets.md §3).

`probe(target, device)` loads the tiny checkpoint through `target.load_ar` and builds it through
`target.build_ar`, then calls each member once and checks its return type and shapes against the
tiny configuration; `parity.conformance` runs it before any suite. Each failure is one line naming
the member.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.conformance import Checks, shape_text
from parity.localise.validate import stage_map_report
from parity.observe.taps import TapSet
from parity.suites.ar.support import moe_observation
from parity.suites.families import probe_loaders
from parity.target import ARAdapter, CaptureRegistry
from reference_models.ar.config import ar_config
from reference_models.checkpoints import random_state_dict


def _is_tensor(value: Any, *shape: int) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == shape


def _check_site(checks: Checks, adapter: Any, site: Any, ids: torch.Tensor) -> None:
    """The site's fields, and its taps in one of the two forms `moe_observation` reads."""
    fields = ("layer", "pre_norm", "layer_module", "und", "gen")
    if not checks.expect(
        all(hasattr(site, f) for f in fields), f"a moe site must have {', '.join(fields)}, got {type(site).__name__}"
    ):
        return
    hooked = all(isinstance(m, torch.nn.Module) for m in (site.pre_norm, site.layer_module))
    if not checks.expect(hooked, "moe site pre_norm and layer_module must be nn.Modules (the harness hooks them)"):
        return
    taps = TapSet({"norm": site.pre_norm, "layer": site.layer_module})
    try:
        checks.attempt("forward(ids) with taps on the first MoE site", lambda: adapter.forward(ids))
        calls = taps.snapshot()
    finally:
        taps.remove()
    if not checks.expect(all(calls.values()), "forward(ids) never called the first MoE site's pre_norm or layer_module"):
        return
    form = checks.attempt("reading the MoE site's taps", lambda: moe_observation(calls["norm"][0], calls["layer"][0], site.layer))
    if form is not None:
        kind = "plain" if form[3] else "fused-residual (out, residual)"
        checks.checked.append(f"moe site {site.layer}: {kind} taps, x {list(form[0].shape)}")
        x = form[0]
        for expert in ("und", "gen"):  # the harness recomputes both experts on the tapped input (docs/targets.md §4)
            out = checks.attempt(f"moe site {site.layer}.{expert}(x)", lambda e=expert: getattr(site, e)(x))
            checks.expect(
                isinstance(out, torch.Tensor) and out.shape == x.shape,
                f"moe site {site.layer}.{expert}(x {list(x.shape)}) must return a tensor shaped like x, got {shape_text(out)}",
                f"moe site {site.layer}.{expert}(x) -> {list(x.shape)}",
            )


# The batches `decode_graph_key` is asked about, one host value per row (docs/targets.md §3.2):
# True a gen token, False a text token, None a row whose kind the host does not know.
KEY_BATCHES = (
    ("all text", [False, False]),
    ("all gen", [True, True]),
    ("mixed", [False, True]),
    ("a row of unknown kind", [None, False]),
)


def _check_decode_graphs(checks: Checks, adapter: Any, width: int, device: str) -> None:
    """The mask-keyed decode graph members (docs/targets.md §3.2), when `decode_graph_keys` is
    declared: every key selectable with a decode step of the right shape after it (the suites
    capture one graph per key), None restoring the default, and `decode_graph_key` answering a
    declared key for each kind of batch (the suites replay the graph of the key it answers)."""
    keys = getattr(adapter, "decode_graph_keys", None)
    if not keys:
        checks.checked.append("decode_graph_keys not declared: one decode graph per batch size")
        return
    if not checks.expect(
        isinstance(keys, (tuple, list)) and all(isinstance(k, str) and k for k in keys) and len(set(keys)) == len(keys),
        f"decode_graph_keys must be a tuple of distinct non-empty str keys, got {keys!r}"[:300],
    ):
        return
    members = [m for m in ("select_decode_graph", "decode_graph_key") if not callable(getattr(adapter, m, None))]
    if not checks.expect(not members, f"declares decode_graph_keys {tuple(keys)} but lacks {', '.join(members)}"):
        return

    def called(call: str, fn: Any) -> tuple[bool, Any]:
        """`checks.attempt`, and whether the call returned (a raise is already a problem)."""
        problems = len(checks.problems)
        value = checks.attempt(call, fn)
        return len(checks.problems) == problems, value

    ids = torch.zeros(1, 1, dtype=torch.long, device=device)  # as the suites capture: all-zero ids and positions
    position = torch.zeros(1, dtype=torch.long, device=device)
    for key in keys:
        selected, _ = called(f"select_decode_graph({key!r})", lambda key=key: adapter.select_decode_graph(key))
        if not selected:
            continue
        stepped, step = called(f"decode_step after select_decode_graph({key!r})", lambda: adapter.decode_step(ids, position))
        if stepped:
            checks.expect(
                _is_tensor(step, 1, width),
                f"decode_step(ids [1, 1], positions [1]) after select_decode_graph({key!r}) must return [1, {width}], "
                f"got {shape_text(step)}",
            )
    called("select_decode_graph(None)", lambda: adapter.select_decode_graph(None))
    wrong = []
    for kind, generating in KEY_BATCHES:
        answered, key = called(f"decode_graph_key({generating})", lambda rows=generating: adapter.decode_graph_key(list(rows)))
        if answered and not (isinstance(key, str) and key in keys):
            wrong.append(f"{key!r} for {generating} ({kind})")
    checks.expect(
        not wrong,
        f"decode_graph_key(generating) must answer one of decode_graph_keys {tuple(keys)}: returned {', '.join(wrong)}"[:500],
    )
    checks.checked.append(f"decode graphs {tuple(keys)}: each selectable, None restores; decode_graph_key answers a declared key")


def probe(target: Any, device: str) -> list[str]:
    config = ar_config("tiny")
    width, hidden, layers = config.logits_width, config.hidden_size, config.num_hidden_layers
    checks = Checks("AR adapter")
    state = random_state_dict(config, 0, device, torch.float32)
    loaded = probe_loaders(
        checks, target, "ar", ARAdapter, config=config, state=state, device=device, expected="an AR adapter, docs/targets.md §3"
    )
    if loaded is None:
        return checks.done()
    adapter, built, names = loaded
    checks.expect(
        isinstance(adapter.module, torch.nn.Module),
        f"module must be the nn.Module holding every parameter (weight_coverage records reads on it), got {type(adapter.module).__name__}",
        "module is an nn.Module",
    )
    if (
        checks.expect(
            isinstance(adapter.supports_capture, bool), f"supports_capture must be a bool, got {adapter.supports_capture!r}"
        )
        and not adapter.supports_capture
    ):
        checks.checked.append("supports_capture False: the graph and compiled modes of the AR suites skip")
    checks.require(adapter.capture, CaptureRegistry, f"{checks.what}.capture")
    problems, checked = stage_map_report(adapter, "ar", layers)
    checks.problems += problems
    checks.checked += [checked] if checked else []
    expected_moe = config.moe_layers
    checks.expect(
        tuple(adapter.moe_layers) == expected_moe,
        f"moe_layers must be {expected_moe} for moe_type {config.moe_type!r}, got {adapter.moe_layers!r}",
        f"moe_layers {expected_moe}",
    )

    ids = torch.tensor([[3, 17, config.gen_vocab_start_index + 4, 42, config.gen_vocab_start_index + 20, 5]], device=device)
    length = ids.shape[1]
    embeds = checks.attempt("embed(ids)", lambda: adapter.embed(ids))
    checks.expect(
        _is_tensor(embeds, 1, length, hidden),
        f"embed(ids [1, {length}]) must return [1, {length}, {hidden}], got {shape_text(embeds)}",
        f"embed -> [1, {length}, {hidden}]",
    )
    for call, fn in (
        ("forward(ids)", lambda: adapter.forward(ids)),
        ("forward_multimodal(embeds, ids)", lambda: adapter.forward_multimodal(embeds, ids)),
        ("forward(ids) of the adapter build_ar returned", lambda: built.forward(ids)),
    ):
        out = checks.attempt(call, fn)
        if out is None:
            continue
        logits, states = getattr(out, "logits", None), getattr(out, "hidden_states", None)
        checks.expect(
            _is_tensor(logits, 1, length, width),
            f"{call} must return an object with .logits [1, {length}, {width}] (a dataclass or NamedTuple), got "
            + (shape_text(logits) if hasattr(out, "logits") else f"{type(out).__name__} without .logits"),
            f"{call}.logits [1, {length}, {width}]",
        )
        checks.expect(
            isinstance(states, (tuple, list)) and len(states) == layers and all(_is_tensor(s, 1, length, hidden) for s in states),
            f"{call}.hidden_states must hold {layers} tensors [1, {length}, {hidden}] (one per decoder layer), got "
            f"{type(states).__name__} of {len(states) if isinstance(states, (tuple, list)) else '?'}",
            f"{call}.hidden_states {layers} x [1, {length}, {hidden}]",
        )

    sites = checks.attempt("moe_sites()", adapter.moe_sites) or []
    layers_seen = [getattr(s, "layer", None) for s in sites]
    checks.expect(
        layers_seen == list(expected_moe),
        f"moe_sites() must give one site per MoE layer {list(expected_moe)}, got layers {layers_seen}",
        f"moe_sites() layers {list(expected_moe)}",
    )
    if sites:
        _check_site(checks, adapter, sites[0], ids)
    modules = checks.attempt("embedding_modules()", adapter.embedding_modules)
    checks.expect(
        isinstance(modules, (tuple, list))
        and len(modules) == 2
        and all(isinstance(m, torch.nn.Module) and hasattr(m, "num_embeddings") for m in modules),
        f"embedding_modules() must return (base table, gen table) nn.Modules with num_embeddings, got {modules!r}"[:300],
        "embedding_modules() -> (base, gen)",
    )
    name_map = checks.attempt("weight_name_map()", adapter.weight_name_map) or {}
    named = {n for tensors in name_map.values() for n in tensors}
    # A tensor the map does not name is a loader finding (weight_coverage's unreceived_tensors and
    # unused_tensors rows name it, the run goes on); a name that is no checkpoint tensor is a map
    # spelt wrong, which would judge nothing (docs/targets.md §3).
    checks.expect(
        named <= names,
        f"weight_name_map() must spell checkpoint tensors as in the directory: unknown {sorted(named - names)[:4]}",
        f"weight_name_map() names {len(named)} of the {len(names)} checkpoint tensors, all spelt as in the directory",
    )

    checks.attempt("allocate_decode_state(1, length + 2)", lambda: adapter.allocate_decode_state(1, length + 2))
    prefill = checks.attempt("prefill(ids)", lambda: adapter.prefill(ids))
    checks.expect(
        _is_tensor(prefill, 1, length, width),
        f"prefill(ids) must return [1, {length}, {width}], got {shape_text(prefill)}",
        f"prefill -> [1, {length}, {width}]",
    )
    position = torch.full((1,), length, dtype=torch.long, device=device)
    step = checks.attempt("decode_step(ids [1, 1], positions [1])", lambda: adapter.decode_step(ids[:, :1], position))
    checks.expect(
        _is_tensor(step, 1, width),
        f"decode_step(ids [1, 1], positions [1]) must return [1, {width}], got {shape_text(step)}",
        f"decode_step -> [1, {width}]",
    )
    _check_decode_graphs(checks, adapter, width, device)
    generated = checks.attempt("greedy_generate(ids, 2)", lambda: adapter.greedy_generate(ids, 2))
    if generated is not None:
        tokens, step_logits = getattr(generated, "tokens", None), getattr(generated, "step_logits", None)
        checks.expect(
            _is_tensor(tokens, 1, 2) and _is_tensor(step_logits, 1, 2, width),
            f"greedy_generate(ids, 2) must return .tokens [1, 2] and .step_logits [1, 2, {width}], got {shape_text(tokens)}, {shape_text(step_logits)}",
            f"greedy_generate -> tokens [1, 2], step_logits [1, 2, {width}]",
        )
    return checks.done()

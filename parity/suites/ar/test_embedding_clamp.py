"""embedding_clamp: both embedding lookups stay in range for any id, inside graphs too.

A graph-safe dual lookup runs both tables on every token and selects with `where`, so the
discarded side of the blend is looked up too: it must be clamped (vllm-project/vllm-omni#7432), and the async
scheduler's -1 sentinel must be safe (vllm-project/vllm-omni#7319). The harness observes the indices each
embedding module receives (taps), checks valid ids against the reference's rows bit for bit and
out-of-range ids against the documented clamped rows, and holds the compiled lookup to eager
bitwise with one compiled frame across lengths.
"""

from __future__ import annotations

import pytest
import torch

from parity.compare import AT_MOST, EXACT, count_rule, diff
from parity.observe.compile_ledger import CompileLedger
from parity.observe.dynamic import dynamic_compile
from parity.runners import make_runner
from parity.suites.ar.support import CASES, TOL, ClampCase, ids_of, resolve_token
from parity.suites.conftest import require_graph_support

pytestmark = pytest.mark.parity_suite("embedding_clamp")

CLAMP = CASES["clamp"]
COMPILE = CASES["clamp_compile"]


def _case_ids(models, cases) -> torch.Tensor:
    """One batch row holding every case's id, between ordinary text tokens."""
    row = [3]
    for case in cases:
        row += [resolve_token(case.token, models.config, models.size), 7]
    return torch.tensor([row], dtype=torch.long, device=models.device)


def _applicable(models, cases):
    """The reference indexes upstream-style (an out-of-range id raises there by design): only
    in-range ids apply to it; a serving target gets every id."""
    if getattr(models.target, "supports_capture", True):
        return list(cases)
    top = models.start + models.config.gen_vocab_size
    return [c for c in cases if 0 <= resolve_token(c.token, models.config, models.size) < top]


def _lookup_taps(models) -> dict:
    """Taps on both embedding tables: what each lookup received. The compiled tests of this suite
    share them, so they share one compiled `embed` (docs/capture-and-compile.md §3)."""
    base, gen = models.target.embedding_modules()
    return {"base": base} | ({"gen": gen} if gen is not None else {})


@pytest.mark.parity_keep_compile_cache
def test_both_lookups_receive_only_in_range_indices(mode: str, ar_models, report) -> None:
    models = ar_models
    require_graph_support(models.target, mode)
    cases = _applicable(models, CLAMP)
    tables = _lookup_taps(models)
    ids = _case_ids(models, cases)
    runner = make_runner(mode, device=models.device, capture_registry=models.target.capture)
    with runner.prepare(models.target.embed, (ids,), dummy="zeros", taps=tables, name="embed") as run:
        taps = run(ids).taps
    for name, module in tables.items():
        size = module.num_embeddings
        seen = [call.input for call in taps[name]]
        for i, case in enumerate(cases):
            position = 1 + 2 * i
            bad = []
            for indices in seen:
                flat = indices.reshape(ids.shape) if indices.numel() == ids.numel() else None
                if flat is None:  # a lookup on a subset of rows (the reference's gen table): check all of it
                    out = indices[(indices < 0) | (indices >= size)]
                    bad += [int(v) for v in out]
                elif not 0 <= int(flat[0, position]) < size:
                    bad.append(int(flat[0, position]))
            report.verdict(
                count_rule(
                    len(bad),
                    0,
                    metric="out_of_range_indices",
                    at=AT_MOST,
                    detail=f"{name} table of {size} rows received {bad or 'only in-range indices'} for id {int(ids[0, position])}",
                ),
                case=case.name,
                mode=mode,
                site=f"{name}_embedding",
            )


@pytest.mark.parametrize("case", CLAMP, ids=ids_of(CLAMP))
def test_each_id_embeds_as_documented(case: ClampCase, ar_models, report) -> None:
    """An id inside the tables embeds bitwise as the reference's row; an id outside them as the
    documented clamped row: -1 and other negatives as id 0, ids past the gen table as its last
    row (docs/model.md §5)."""
    models = ar_models
    report.case = case.name  # an exception's error row names this case
    token = resolve_token(case.token, models.config, models.size)
    ids = torch.tensor([[token]], device=models.device)
    if 0 <= token < models.start + models.config.gen_vocab_size:
        report.diff(
            diff(models.reference.embed(ids), models.target.embed(ids), TOL["embedding_exact"], name=f"id {token}"),
            case=case.name,
        )
        return
    if not getattr(models.target, "supports_capture", True):
        pytest.skip(f"{models.target.name} target indexes upstream-style: id {token} outside both tables raises there by design")
    base, gen = models.reference.embedding_modules()
    rows = {"base:0": base.weight[0], "base:last": base.weight[-1], "gen:0": gen.weight[0], "gen:last": gen.weight[-1]}
    got = models.target.embed(ids)[0, 0]
    report.diff(
        diff(rows[case.expect], got, TOL["embedding_exact"], name=f"id {token} -> {case.expect}"),
        case=case.name,
        site=case.expect,
    )


@pytest.mark.parity_keep_compile_cache
@pytest.mark.parity_compiles
def test_compiled_lookup_equals_eager_bitwise(ar_models, report) -> None:
    models = ar_models
    require_graph_support(models.target, "compiled")
    ids = _case_ids(models, CLAMP)
    compiled = make_runner("compiled", device=models.device, capture_registry=models.target.capture)
    with compiled.prepare(models.target.embed, (ids,), taps=_lookup_taps(models), name="embed") as run:
        got = run(ids).output
    report.diff(diff(models.target.embed(ids), got, EXACT, name="compiled embed vs eager"), case="all-clamp-ids", mode="compiled")


@pytest.mark.parity_compiles
def test_one_compiled_frame_across_lengths(ar_models, report) -> None:
    models = ar_models
    require_graph_support(models.target, "compiled")
    with CompileLedger() as ledger:
        compiled = dynamic_compile(models.target.embed, fullgraph=True, dynamic=True, backend="inductor")
        for length in COMPILE.lengths:
            ids = torch.arange(length, device=models.device)[None] * 37 % (models.start + models.config.gen_vocab_size + 9) - 1
            compiled(ids)
    row = ledger.expect_compiles(models.target.embed, COMPILE.expected_compiles, why=COMPILE.reason)
    report.record(case="lengths-" + "-".join(map(str, COMPILE.lengths)), mode="compiled", **row)

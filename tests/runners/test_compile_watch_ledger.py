"""The compile ledger on toy functions: counts per code object, reasons, breaks, silent fallback.

Backend "eager": the ledger watches Dynamo (frames, guards, cache entries), which is the same
whatever backend compiles the graph, and the eager backend keeps each compile in milliseconds.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo import convert_frame

from parity.observe.compile_ledger import (
    TESTED_TORCH_VERSIONS,
    CompileLedger,
    CompileWatchUnavailable,
    code_label,
    code_location,
    code_of,
    fail_on_recompile,
    reset_compile_state,
)
from parity.observe.dynamic import dynamic_compile

ROW_KEYS = {"metric", "value", "threshold", "verdict", "detail"}


def scale(x):
    return x * 2 + 1


def shape_branch(x):
    if x.shape[0] == 3:
        return x + 1
    return x - 1


def with_graph_break(x):
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1


def _cumulative_compiles(fn, sizes, **compile_kwargs):
    counts = []
    with CompileLedger() as ledger:
        compiled = torch.compile(fn, backend="eager", **compile_kwargs)
        for size in sizes:
            compiled(torch.randn(size))
            counts.append(ledger.compiles(fn))
    return counts, ledger


def test_sizes_zero_and_one_compile_again_even_with_dynamic_true():
    counts, ledger = _cumulative_compiles(scale, [5, 6, 7, 1, 0, 8], dynamic=True, fullgraph=True)
    # 5: first compile, symbolic in the size; 6, 7: reuse it; 1 and 0: Dynamo specializes sizes 0
    # and 1 even with dynamic=True ("The Zero-One Specialization Problem"), one compile each;
    # 8: back on the symbolic graph. Same table as measured on an H200 with torch 2.11
    # (docs/capture-and-compile.md §3).
    assert counts == [1, 1, 1, 2, 3, 3]
    reasons = ledger.recompile_reasons(scale)
    assert len(reasons) == 2
    assert "size()[0]" in reasons[0]  # size 1 failed the symbolic graph's `2 <= size` guard
    assert "size mismatch" in reasons[1] or "size()[0]" in reasons[1]


def test_dynamic_false_compiles_every_new_size():
    counts, _ = _cumulative_compiles(scale, [5, 6, 7], dynamic=False, fullgraph=True)
    assert counts == [1, 2, 3]  # one static graph per size


def test_a_shape_branch_recompiles_with_a_guard_failure_reason():
    counts, ledger = _cumulative_compiles(shape_branch, [5, 6, 3, 4], dynamic=True, fullgraph=True)
    # 5: compiled for "size != 3"; 6 reuses it; 3 fails that guard: second graph; 4 reuses the first.
    assert counts == [1, 1, 2, 2]
    (reason,) = ledger.recompile_reasons(shape_branch)
    assert "size()[0]" in reason and "3" in reason
    (event,) = ledger.recompiles(shape_branch)
    assert event.kind == "recompile" and event.label == "shape_branch"


def test_counts_only_the_asked_code_object():
    compiled_activation = torch.compile(torch.nn.functional.silu, backend="eager")

    def block_forward(x):  # a block that is NOT compiled, calling a library op that is
        return compiled_activation(x) * 2

    with CompileLedger() as ledger:
        block_forward(torch.randn(4))
    assert ledger.compiles() >= 1  # an all-frames counter would pass here...
    assert ledger.compiles(block_forward) == 0  # ...while the block never compiled


def test_graph_breaks_are_counted_with_reasons():
    with CompileLedger() as ledger:
        torch.compile(with_graph_break, backend="eager")(torch.randn(3))
    breaks = ledger.graph_breaks()
    assert sum(breaks.values()) == 1
    (reason,) = breaks
    assert "graph_break" in reason
    row = next(r for r in ledger.rows() if r["metric"] == "graph_breaks")
    assert row["value"] == 1 and "graph_break" in row["detail"]


def test_fullgraph_turns_a_graph_break_into_an_error_the_ledger_records():
    with CompileLedger() as ledger, pytest.raises(Exception, match="graph_break"):
        torch.compile(with_graph_break, backend="eager", fullgraph=True)(torch.randn(3))
    (event,) = ledger.events
    assert event.kind == "failed" and event.raised


def test_silent_eager_fallback_past_the_recompile_limit_is_a_failure():
    sizes = [5, 6, 7, 1, 0, 8]
    with torch._dynamo.config.patch(recompile_limit=2), CompileLedger() as ledger:
        compiled = ledger.count_calls(torch.compile(scale, backend="eager", dynamic=False))
        for size in sizes:
            torch.testing.assert_close(compiled(torch.ones(size)), torch.full((size,), 3.0))  # no error raised
    # Calls rise to 6 while compiles stay at the limit: the last four sizes ran eagerly.
    assert ledger.calls(scale) == 6
    assert ledger.compiles(scale) == 2
    (hit,) = ledger.limit_hits(scale)
    assert hit.limit_type == "recompile_limit" and hit.limit_value == 2 and not hit.raised
    (fallback,) = ledger.eager_fallbacks()
    assert fallback.code is scale.__code__
    assert fallback.hit_at_call == 3 and fallback.calls_since == 4
    failing = {row["metric"]: row for row in ledger.rows() if row["verdict"] == "fail"}
    assert failing["eager_fallback_calls[scale]"]["value"] == 4
    assert "recompile_limit_hit[scale]" in failing


def test_with_fullgraph_the_limit_hit_raises_and_is_not_a_silent_fallback():
    with torch._dynamo.config.patch(recompile_limit=2), CompileLedger() as ledger:
        compiled = torch.compile(scale, backend="eager", dynamic=False, fullgraph=True)
        compiled(torch.ones(5))
        compiled(torch.ones(6))
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            compiled(torch.ones(7))
    (hit,) = ledger.limit_hits(scale)
    assert hit.raised
    assert ledger.eager_fallbacks() == []


def test_fail_on_recompile_raises_with_the_reason_and_allows_first_compiles():
    compiled = torch.compile(scale, backend="eager", dynamic=True, fullgraph=True)
    with fail_on_recompile():
        compiled(torch.randn(4))  # a first compile is not a recompile
        compiled(torch.randn(9))  # same symbolic graph
        with pytest.raises(torch._dynamo.exc.RecompileError, match=r"(?s)Recompiling function scale.*size\(\)\[0\]"):
            compiled(torch.randn(1))
    compiled(torch.randn(1))  # outside the context the recompile is allowed


def test_fail_on_recompile_reason_reaches_the_ledger():
    with CompileLedger() as ledger:
        compiled = torch.compile(scale, backend="eager", dynamic=False)
        compiled(torch.randn(4))
        with fail_on_recompile(), pytest.raises(torch._dynamo.exc.RecompileError):
            compiled(torch.randn(5))
    failed = [e for e in ledger.events if e.kind == "failed"]
    assert failed and "size mismatch" in failed[0].reasons[0]


def test_cache_bleed_hides_a_compile_unless_state_is_reset():
    """vllm-project/vllm-omni#7455: two tests compiling the same code object share Dynamo's cache."""
    compiled = torch.compile(scale, backend="eager", dynamic=True)
    compiled(torch.randn(4))  # "an earlier test"
    with CompileLedger() as ledger:
        torch.compile(scale, backend="eager", dynamic=True)(torch.randn(4))
    assert ledger.compiles(scale) == 0  # the cache answered: no compile seen
    reset_compile_state()
    with CompileLedger() as ledger:
        torch.compile(scale, backend="eager", dynamic=True)(torch.randn(4))
    assert ledger.compiles(scale) == 1


def test_rows_are_report_ready():
    with CompileLedger() as ledger:
        counted = ledger.count_calls(torch.compile(shape_branch, backend="eager", dynamic=True))
        for size in (5, 3):
            counted(torch.randn(size))
    rows = {row["metric"]: row for row in ledger.rows()}
    assert all(set(row) == ROW_KEYS for row in rows.values())
    assert rows["compiles[shape_branch]"]["value"] == 2
    assert rows["recompiles[shape_branch]"]["value"] == 1
    assert "size()[0]" in rows["recompiles[shape_branch]"]["detail"]
    assert rows["calls[shape_branch]"]["value"] == 2
    judged = ledger.expect_compiles(shape_branch, 1, why="one graph expected across the lattice")
    assert judged["verdict"] == "fail" and judged["threshold"] == 1 and judged["value"] == 2
    assert ledger.expect_compiles(shape_branch, 2, why="size 3 takes its own branch")["verdict"] == "pass"


def test_ledgers_nest_and_the_patches_come_off():
    original = convert_frame._compile
    with CompileLedger() as outer:
        torch.compile(scale, backend="eager")(torch.randn(3))
        with CompileLedger() as inner:
            torch.compile(shape_branch, backend="eager")(torch.randn(3))
        assert convert_frame._compile is not original
    assert convert_frame._compile is original
    assert outer.compiles(scale) == 1 and outer.compiles(shape_branch) == 1
    assert inner.compiles(scale) == 0 and inner.compiles(shape_branch) == 1


def _major_minor(version: str) -> tuple[int, int]:
    major, minor, *_ = version.split("+")[0].split(".")
    return int(major), int(minor)


def test_the_running_torch_is_one_the_private_hooks_were_tested_on():
    """The ledger wraps private Dynamo functions that may change in any release: a torch outside
    TESTED_TORCH_VERSIONS fails here until these tests have been run on it and it is added."""
    assert _major_minor("2.13.0+cpu") == (2, 13) and _major_minor("2.11.0+cu130") == (2, 11)
    assert _major_minor("2.14.0a0+git1234") not in TESTED_TORCH_VERSIONS  # a newer torch goes red
    assert _major_minor(torch.__version__) in TESTED_TORCH_VERSIONS, (
        f"torch {torch.__version__} is not in parity.observe.compile_ledger.TESTED_TORCH_VERSIONS "
        f"{TESTED_TORCH_VERSIONS}: run tests/runners/test_compile_watch_ledger.py on it, then add it there and "
        "to docs/capture-and-compile.md §4"
    )


def test_missing_private_api_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(convert_frame, "get_and_maybe_log_recompilation_reasons")
    with pytest.raises(CompileWatchUnavailable, match="get_and_maybe_log_recompilation_reasons"):
        CompileLedger().start()


def test_code_of_unwraps_what_suites_hand_it():
    class Block(torch.nn.Module):
        def forward(self, x):
            return x

    block = Block()
    compiled = torch.compile(block.forward, backend="eager")
    for target in (Block.forward, block.forward, block, compiled, Block.forward.__code__):
        assert code_of(target) is Block.forward.__code__
    with pytest.raises(TypeError, match="Block.forward"):
        code_of(Block)


class DecoratedAdapter:
    """Entry points decorated the ordinary way, by decorators from a file Dynamo skips
    (torch/utils/_contextlib.py): `torch.compile` alone would compile them behind
    `wrap_inline`'s one shared frame."""

    @torch.no_grad()
    def forward(self, x):
        return x * 2 + 1

    @torch.inference_mode()
    def embed(self, x):
        return x - 1


@pytest.mark.parametrize(("method", "other"), [("forward", "embed"), ("embed", "forward")])
def test_a_decorated_method_is_counted_as_its_own_code(method, other):
    """Compiled by parity (`dynamic_compile`), a decorated method runs in a frame of its own named
    after it (parity.observe.compile_frames): one compile over sizes 5-7, counted by the method, its
    class function or its compiled wrapper, and not mixed with another decorated method's."""
    reset_compile_state()
    adapter = DecoratedAdapter()
    fn = getattr(adapter, method)
    with CompileLedger() as ledger:
        compiled = dynamic_compile(fn, dynamic=True, fullgraph=True, backend="eager")
        for size in (5, 6, 7):
            compiled(torch.randn(size))
        dynamic_compile(getattr(adapter, other), dynamic=True, fullgraph=True, backend="eager")(torch.randn(5))
    assert ledger.compiles(fn) == 1, [(event.label, event.kind) for event in ledger.events]
    assert code_of(getattr(DecoratedAdapter, method)) is code_of(fn) is code_of(compiled)
    assert code_label(code_of(fn)) == f"DecoratedAdapter.{method}"
    assert code_location(code_of(fn)).startswith(__file__)  # the method's file, not parity's frame
    assert ledger.compiles(getattr(adapter, other)) == 1 and ledger.compiles() == 2


def test_decorated_methods_of_one_name_are_two_codes():
    """Code objects compare by content (their qualname aside): two classes' decorated `forward`s
    still get frames that are two keys, so calls counted for one are not the other's."""

    class Other:
        @torch.no_grad()
        def forward(self, x):
            return x

    mine, theirs = code_of(DecoratedAdapter.forward), code_of(Other.forward)
    assert mine != theirs and len({mine, theirs}) == 2
    ledger = CompileLedger()
    ledger.count_calls(DecoratedAdapter().forward)(torch.ones(1))
    assert ledger.calls(DecoratedAdapter.forward) == 1 and ledger.calls(Other.forward) == 0

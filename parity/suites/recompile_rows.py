"""The summary rows of a recompile suite (AR `test_recompiles`, DiT `test_recompiles`), written once.

After the lattice ran under a `CompileLedger`, both suites write under case `summary`: a gate on
the graph breaks (none: the frames compile with fullgraph=True), a gate on eager fallback (a
recompile limit hit on the watched frames is a failure even before a call fell back; the row
shows the calls that ran eager since), any gates of their own, and the ledger's per-frame counts
as info rows (compiles, recompiles, calls, limit hits).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from parity.compare import AT_MOST, PASS, Verdict, count_rule, flag_rule
from parity.observe.compile_ledger import CompileLedger


def write_ledger_summary(
    report: Any,
    ledger: CompileLedger,
    codes: Sequence[Any],
    *,
    site: str,
    calls_noun: str = "calls",
    extra: Iterable[tuple[Verdict, dict[str, Any]]] = (),
) -> None:
    """Write the `summary` rows of `ledger` for the watched code objects `codes` at `site`.

    `calls_noun` names what went through the compiled frames in the eager-fallback row's detail
    ("calls" of the forward, "block calls"); `extra` are a suite's own gates, (verdict, where),
    written after the shared ones and before the ledger's info rows.
    """
    report.case = "summary"
    breaks = ledger.graph_breaks()
    report.verdict(
        count_rule(
            sum(breaks.values()),
            0,
            metric="graph_breaks",
            at=AT_MOST,
            detail="; ".join(f"{n}x {reason}" for reason, n in breaks.items()) or "none (fullgraph=True)",
        ),
        site=site,
    )
    fallbacks = [fb for fb in ledger.eager_fallbacks() if fb.code in codes]
    calls = sum(ledger.calls(code) for code in codes)
    described = "; ".join(
        f"{fb.label}: {fb.limit_type} hit at call {fb.hit_at_call}, {fb.calls_since} calls since" for fb in fallbacks
    )
    # a limit hit is a failure even before any call fell back (calls_since 0): the flag decides,
    # the row shows the calls that ran eager since
    report.verdict(
        flag_rule(
            not fallbacks,
            metric="eager_fallback",
            value=sum(fb.calls_since or 0 for fb in fallbacks),
            threshold=0,
            detail=described or f"no recompile limit hit; {calls} {calls_noun} went through the compiled forward",
        ),
        site=site,
    )
    for verdict, where in extra:
        report.verdict(verdict, **where)
    for row in ledger.rows():  # every code object Dynamo touched, with its reasons (counts: info)
        if row["metric"] != "graph_breaks":  # already the gate row above
            report.info(site=site, **{**row, "verdict": row["verdict"] or PASS})

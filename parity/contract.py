"""The requirements the suites check on a target that are not a member's type or shape, one record
each: the docs/targets.md section that states it and the exact words the check uses.

A check that enforces one of these builds its message (or the literal it looks for) from the
record, so the check and the contract quote the same words; `tests/harness/test_contract_doc.py` holds
docs/targets.md to every record (the words, backticked, and the rule, verbatim, in the section)
and holds every member the suites and probes read off a target to the page.
"""

from __future__ import annotations

import dataclasses

DOC = "docs/targets.md"


@dataclasses.dataclass(frozen=True)
class Requirement:
    """One requirement: `words` is what the check looks for or names (a literal the target's text
    must contain, a member name, a compile setting), `rule` the sentence fragment the contract and
    the check's message share, `section` the docs/targets.md section ("3.1") that states it."""

    key: str
    section: str
    words: str
    rule: str

    @property
    def cite(self) -> str:
        return f"{DOC} §{self.section}"


def _index(*requirements: Requirement) -> dict[str, Requirement]:
    return {r.key: r for r in requirements}


REQUIREMENTS: dict[str, Requirement] = _index(
    # The refusal of a capture without a mask (fail_closed_capture, one row per phrase; the key is
    # the row's metric).
    Requirement("names_the_layer", "3.1", "model.layers.", "the refusal names the MoE layer by its module path"),
    Requirement("offers_enforce_eager", "3.1", "enforce_eager", "the refusal offers eager execution"),
    Requirement(
        "says_piecewise_is_not_a_workaround",
        "3.1",
        "PIECEWISE is not a workaround",
        "the refusal says piecewise capture does not help",
    ),
    # The capture probe (fail_closed_capture's missing-probe rows).
    Requirement("is_capturing_every_forward", "2.1", "is_capturing", "asked on every forward, ids given or not"),
    Requirement("probe_warning_text", "2.1", "probe", "warns once per process, with the word probe in the text"),
    # The pipeline-parallel factory and the multimodal attribute (fail_closed_capture).
    Requirement(
        "pipeline_factory",
        "3",
        "make_empty_intermediate_tensors",
        "seeds a bool gen_token_mask of zeros",
    ),
    Requirement("raw_input_tokens", "3", "requires_raw_input_tokens", "True on the module's class and each AR wrapper class"),
    # Mask-keyed decode graphs (decode, expert_selection's keyed_decode test).
    Requirement("decode_graph_keys", "3.2", "decode_graph_keys", "mask-keyed decode graphs"),
    # How the compiled modes compile (parity.runners.make_runner's defaults, the recompiles suites).
    Requirement("compile_settings", "2.2", "fullgraph=True, dynamic=True", "compiled whole, with dynamic shapes"),
    Requirement("regional_compile", "6", "_repeated_blocks", "every submodule whose class name is listed is compiled"),
)


def requirement(key: str) -> Requirement:
    """The record for `key` (a KeyError names the known keys)."""
    try:
        return REQUIREMENTS[key]
    except KeyError:
        raise KeyError(f"no contract requirement {key!r}; known: {', '.join(REQUIREMENTS)}") from None


def words(key: str) -> str:
    return requirement(key).words


REFUSAL_PHRASES: dict[str, str] = {
    key: REQUIREMENTS[key].words for key in ("offers_enforce_eager", "says_piecewise_is_not_a_workaround", "names_the_layer")
}
"""What a capture refusal must contain, by the metric of its row (fail_closed_capture)."""

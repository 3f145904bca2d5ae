"""The stage tables of docs/localise.md §2, generated from the vocabularies, so the page cannot
fall behind them: `python -m tests.support.localise_doc` rewrites each family's table in place
(between its `<!-- stages:<family> -->` and `<!-- /stages:<family> -->` lines), and
tests/repo/test_localise_doc.py fails when one is stale or lacks a stage.

A family of `parity.localise.vocabulary.FAMILY_VOCABULARIES` without a vocabulary module yet gets a
marked placeholder; one whose module exists but does not import is an error, never a placeholder.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from parity.localise.stages import Vocabulary
from parity.localise.vocabulary import FAMILY_VOCABULARIES, vocabulary

DOC = Path(__file__).resolve().parents[2] / "docs" / "localise.md"
REGENERATE = "python -m tests.support.localise_doc"


def begin(family: str) -> str:
    return f"<!-- stages:{family} (generated from the {family} vocabulary by `{REGENERATE}`: do not edit) -->"


def end(family: str) -> str:
    return f"<!-- /stages:{family} -->"


def has_vocabulary(family: str) -> bool:
    return importlib.util.find_spec(FAMILY_VOCABULARIES[family].partition(":")[0]) is not None


def stage_keys(vocab: Vocabulary, name: str) -> list[str]:
    """How a stage map spells stage `name`: once per block list for a per-layer stage."""
    stage = vocab.stage(name)
    return [vocab.key(stage, blocks.name) for blocks in vocab.blocks] if stage.per_layer else [stage.name]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(vocab: Vocabulary) -> list[str]:
    """The vocabulary as markdown: how its block lists chain (when it has per-layer stages), then one
    row per stage in execution order."""
    lines = []
    if any(stage.per_layer for stage in vocab.stages):
        lists = []
        for blocks in vocab.blocks:
            entry = ", ".join(f"`{e}`" for e in (blocks.entry or (vocab.entry,)))
            lists.append(f"`{blocks.name}` (whose first block's `prev:` reads {entry})")
        across = any(":" in e for blocks in vocab.blocks for e in blocks.entry)
        lines += [
            f"Per-layer stages repeat, in this order, for every block of {', then '.join(lists)}; `prev:<stage>` "
            "reads that stage of the previous block, `last:<stage>` that stage of the last block"
            + (", `<list>:<stage>` that stage of the last block of block list `<list>`." if across else "."),
            "",
        ]
    lines += ["| # | stage_map key | what it is | reads | rows |", "|---|---|---|---|---|"]
    for n, stage in enumerate(vocab.stages, 1):
        keys = "<br>".join(f"`{key}`" for key in stage_keys(vocab, stage.name))
        reads = ", ".join(f"`{name}`" for name in stage.inputs) or "the case's input"
        lines.append(f"| {n} | {keys} | {_cell(stage.what)} | {reads} | {stage.rows} |")
    return lines


def block(family: str) -> str:
    """A family's generated block, markers included."""
    if has_vocabulary(family):
        body = table(vocabulary(family))
    else:
        body = [f"**To be generated:** no `{family}` vocabulary yet; run `{REGENERATE}` once it exists."]
    return "\n".join([begin(family), *body, end(family)])


def _span(family: str) -> re.Pattern[str]:
    return re.compile(re.escape(begin(family)) + r"\n.*?" + re.escape(end(family)), re.S)


def written_block(text: str, family: str) -> str | None:
    """The block of `family` as the page holds it (None: the page has none)."""
    found = _span(family).search(text)
    return found.group(0) if found else None


def missing_stages(text: str, family: str) -> list[str]:
    """The stage_map keys of `family`'s vocabulary that no row of its table on the page names."""
    written = written_block(text, family) or ""
    rows = [line for line in written.splitlines() if line.startswith("| ")]
    return [key for key in vocabulary(family).keys() if not any(f"`{key}`" in row for row in rows)]  # noqa: SIM118 (a method, not a dict)


def regenerate(text: str) -> str:
    """`text` with every family's block replaced by the generated one (a family without a block is an error)."""
    for family in FAMILY_VOCABULARIES:
        if written_block(text, family) is None:
            raise SystemExit(f"{DOC}: no `{begin(family)}` ... `{end(family)}` lines for {family}: add them where its table goes")
        text = _span(family).sub(lambda _, f=family: block(f), text)
    return text


if __name__ == "__main__":
    DOC.write_text(regenerate(DOC.read_text(encoding="utf-8")), encoding="utf-8")
    sys.stdout.write(f"{DOC}: stage tables of {', '.join(FAMILY_VOCABULARIES)} regenerated\n")

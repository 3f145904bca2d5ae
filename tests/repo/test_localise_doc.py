"""docs/localise.md §2 lists every stage of every vocabulary, as the vocabulary holds it: its tables
are generated (tests/support/localise_doc.py) and must be current. Nothing is tolerated: a family of
`FAMILY_VOCABULARIES` whose module exists must have its table, and every stage_map key of it must be
a row; a module that does not import fails here, never turns into a placeholder."""

from __future__ import annotations

import dataclasses

import pytest

from parity.localise.stages import Stage
from parity.localise.vocabulary import FAMILY_VOCABULARIES, vocabulary
from tests.support import localise_doc
from tests.support.localise_doc import DOC, REGENERATE, block, has_vocabulary, missing_stages, written_block


@pytest.mark.parametrize("family", FAMILY_VOCABULARIES)
def test_the_stage_table_of_each_family_is_current(family: str) -> None:
    text = DOC.read_text(encoding="utf-8")
    written = written_block(text, family)
    assert written is not None, f"docs/localise.md has no stage table for {family}: add its marker lines and run `{REGENERATE}`"
    assert written == block(family), f"docs/localise.md's {family} stage table is stale: run `{REGENERATE}`"


@pytest.mark.parametrize("family", FAMILY_VOCABULARIES)
def test_every_stage_of_every_vocabulary_is_listed(family: str) -> None:
    if not has_vocabulary(family):
        assert "To be generated" in (written_block(DOC.read_text(encoding="utf-8"), family) or "")
        return
    assert vocabulary(family).keys(), f"the {family} vocabulary has no stages"
    assert missing_stages(DOC.read_text(encoding="utf-8"), family) == []


def test_a_stage_added_to_a_vocabulary_makes_the_page_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above can fail: one more AR stage is missing from the committed page, by name."""
    ar = vocabulary("ar")
    extra = Stage("q_norm", "a per-head q norm the page does not list", ("q",), per_layer=True)
    grown = dataclasses.replace(ar, stages=(*ar.stages[:4], extra, *ar.stages[4:]))
    monkeypatch.setattr(localise_doc, "vocabulary", lambda family: grown if family == "ar" else vocabulary(family))
    text = DOC.read_text(encoding="utf-8")
    assert missing_stages(text, "ar") == ["layer.{layer}.q_norm"]
    assert written_block(text, "ar") != block("ar")
    assert "`layer.{layer}.q_norm`" in block("ar")


def test_a_table_without_its_rows_is_caught() -> None:
    """The broken variant of the page: the AR table with its `lm_head` row removed."""
    text = DOC.read_text(encoding="utf-8")
    broken = "\n".join(line for line in text.splitlines() if not (line.startswith("| ") and "| `lm_head` |" in line))
    assert missing_stages(broken, "ar") == ["lm_head"]
    assert missing_stages(text.replace(written_block(text, "ar"), ""), "ar") == list(vocabulary("ar").keys())

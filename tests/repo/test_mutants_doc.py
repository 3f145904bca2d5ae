"""docs/mutants.md is generated from the catalogue: it must list every mutant as the catalogue holds it."""

from __future__ import annotations

import sys

from parity.suites.sensitivity.catalogue import all_mutants, markdown
from tests.support.helpers import PROJECT_ROOT, run_command

DOC = PROJECT_ROOT / "docs" / "mutants.md"
REGENERATE = "python -m parity.suites.sensitivity.catalogue --markdown > docs/mutants.md"


def test_the_committed_catalogue_page_is_current() -> None:
    assert DOC.read_text() == markdown(), f"docs/mutants.md is stale: regenerate it with `{REGENERATE}`"


def test_the_page_names_every_mutant_with_its_suite_and_target() -> None:
    text = markdown()
    for name, entry in all_mutants().items():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, name
        assert f"`{entry.suite}`" in row and f"`{entry.target}`" in row, row


def test_a_new_entry_makes_the_committed_page_stale() -> None:
    """The staleness check can fail: a catalogue with one more entry no longer matches the file."""
    from parity.suites.sensitivity import catalogue

    extra = dict(all_mutants())
    extra["fake-new-mutant"] = catalogue.Mutant(
        "fake-new-mutant",
        "a defect added without regenerating the page",
        "numerics",
        "serving",
        {"cpu": catalogue.Kill(("x",)), "cuda": catalogue.Kill(("x",))},
    )
    assert DOC.read_text() != markdown(extra)
    assert "`fake-new-mutant`" in markdown(extra)


def test_the_module_prints_the_page() -> None:
    done = run_command([sys.executable, "-m", "parity.suites.sensitivity.catalogue", "--markdown"], cwd=PROJECT_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == markdown()

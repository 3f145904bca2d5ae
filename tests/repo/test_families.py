"""Every list of model families holds exactly the families of `parity.target.FAMILIES` that its
record field asks for: none it does not know, none missed (CONTRIBUTING.md "Add a model family").

The harness's lists derive from the record (`SUITE_CASE_FILES`, `FAMILY_VOCABULARIES`, the review
page's per-site plots, make-checkpoint's kinds); the suites' model fixtures are written once per
family with `family_models`; the model side keys its registries (release layouts, checkpoint
makers and writers) by the family's key without importing the record. Each list is read here as it
is at run time (the fixtures and the suites' directories from the source), so a list written by
hand again, or a family added to the record without its parts, fails with a line naming the list
and the key. `test_a_list_that_drifts_is_named` shows the check going red.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Mapping
from pathlib import Path

import pytest

from parity.target import FAMILIES, Family
from tests.support.helpers import PROJECT_ROOT

SUITES = PROJECT_ROOT / "parity" / "suites"
HARNESS_SUITES = {"selfcheck", "sensitivity", "benchmarks"}  # suite directories of no model family


def fixtures_in_conftest(path: Path = SUITES / "conftest.py") -> dict[str, str]:
    """The suites' model fixtures as the conftest writes them: `name = family_models("key", ...)`
    -> {name: key}; a hand-written `*_models` fixture (a function) maps to '' (it bypasses the
    family's one guard)."""
    found: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            if isinstance(call.func, ast.Name) and call.func.id == "family_models" and call.args:
                key = call.args[0].value if isinstance(call.args[0], ast.Constant) else ""
                found.update({target.id: str(key) for target in node.targets if isinstance(target, ast.Name)})
        elif (
            isinstance(node, ast.FunctionDef)
            and node.name.endswith("_models")
            and any("fixture" in ast.unparse(decorator) for decorator in node.decorator_list)
        ):
            found[node.name] = ""
    return found


def make_checkpoint_kinds() -> set[str]:
    """The `kind` choices of `parity make-checkpoint`, from the command line's own parser."""
    from parity.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")  # argparse keeps its subparsers here
    kind = next(a for a in commands.choices["make-checkpoint"]._actions if a.dest == "kind")
    return set(kind.choices)


def family_lists() -> dict[str, tuple[set[str], set[str]]]:
    """Every list keyed by family: its name -> (the keys it holds, the keys the record asks for)."""
    from parity.cases import SUITE_CASE_FILES
    from parity.localise.vocabulary import FAMILY_VOCABULARIES
    from parity.report.plots import SITE_FAMILIES
    from parity.suites.sensitivity.catalogue import FAMILY_TITLES
    from reference_models.checkpoints import MAKERS, RELEASE_WRITERS
    from reference_models.families import LAYOUTS

    def asked(field: str) -> set[str]:
        return {key for key, family in FAMILIES.items() if getattr(family, field)}

    fixtures = fixtures_in_conftest()
    directories = {p.name for p in SUITES.iterdir() if (p / "conformance.py").is_file()}
    vocabulary_modules = {p.stem for p in (PROJECT_ROOT / "parity" / "localise" / "families").glob("*.py")} - {"__init__"}
    return {
        "parity.cases.SUITE_CASE_FILES": (set(SUITE_CASE_FILES) - HARNESS_SUITES, asked("case_file")),
        "parity.localise.vocabulary.FAMILY_VOCABULARIES": (set(FAMILY_VOCABULARIES), asked("vocabulary")),
        "parity/localise/families/*.py": (vocabulary_modules, asked("vocabulary")),
        "parity.report.plots.SITE_FAMILIES": ({f.key for f in SITE_FAMILIES}, asked("sites")),
        "parity make-checkpoint's kinds": (make_checkpoint_kinds(), asked("loader")),
        "the suites' model fixtures (parity/suites/conftest.py)": (set(fixtures.values()), asked("fixture")),
        "parity/suites/<family>/conformance.py": (directories, set(FAMILIES)),
        "the mutant catalogue's groups (FAMILY_TITLES)": (set(FAMILY_TITLES) - {"runners", "selfcheck"}, set(FAMILIES)),
        "reference_models.families.LAYOUTS": (set(LAYOUTS), asked("loader")),
        "reference_models.checkpoints.MAKERS": (set(MAKERS), asked("loader")),
        "reference_models.checkpoints.RELEASE_WRITERS": (set(RELEASE_WRITERS), asked("loader")),
    }


def list_problems(lists: Mapping[str, tuple[set[str], set[str]]], families: Mapping[str, Family] = FAMILIES) -> list[str]:
    """One line per list that names a family the record does not have, or misses one it asks for."""
    problems = []
    for name, (held, wanted) in lists.items():
        unknown, missed = sorted(held - set(families)), sorted(wanted - held)
        if unknown:
            problems.append(f"{name} names {', '.join(unknown)}: not in parity.target.FAMILIES")
        if missed:
            problems.append(f"{name} misses {', '.join(missed)}, which parity.target.FAMILIES says it has")
    return problems


def test_every_family_list_holds_the_families_of_the_record() -> None:
    assert list_problems(family_lists()) == []


def test_each_fixture_is_named_as_its_family_says() -> None:
    assert fixtures_in_conftest() == {f.fixture: key for key, f in FAMILIES.items() if f.fixture}


def test_each_record_field_names_what_exists() -> None:
    """The strings of the record point at real things: case files, vocabularies (of the same
    family), probes, and the loader and builder among the family's members."""
    for key, family in FAMILIES.items():
        if family.case_file:
            assert (PROJECT_ROOT / "cases" / family.case_file).is_file(), (key, family.case_file)
        for path in (family.probe, family.vocabulary):
            if path:
                module, _, attribute = path.partition(":")
                assert hasattr(importlib.import_module(module), attribute), (key, path)
        if family.vocabulary:
            from parity.localise.vocabulary import vocabulary

            assert vocabulary(key).family == key
        assert {m for m in (family.loader, family.builder) if m} <= set(family.members), key
        assert all(s and (s.endswith(".") or "." not in s) for s in family.sites), (key, family.sites)


def test_a_list_that_drifts_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switched-off variant: a list written by hand again, naming a family the record lacks
    and missing one it has, and a family added to the record alone, each give their lines."""
    from parity.localise import vocabulary
    from reference_models import checkpoints

    monkeypatch.setattr(vocabulary, "FAMILY_VOCABULARIES", {"ar": "x:y", "vit": "x:y", "routing": "x:y"})
    monkeypatch.setattr(checkpoints, "MAKERS", {"ar": checkpoints.MAKERS["ar"]})
    problems = list_problems(family_lists())
    assert problems == [
        "parity.localise.vocabulary.FAMILY_VOCABULARIES names vit: not in parity.target.FAMILIES",
        "parity.localise.vocabulary.FAMILY_VOCABULARIES misses dit, which parity.target.FAMILIES says it has",
        "reference_models.checkpoints.MAKERS misses dit, which parity.target.FAMILIES says it has",
    ]
    monkeypatch.undo()

    vit = Family(
        "vit", "ViT", "vision encoder", ("load_vit", "build_vit"), ("numerics",), "x:y", loader="load_vit", fixture="vit_models"
    )
    grown = {**FAMILIES, "vit": vit}
    monkeypatch.setattr("parity.target.FAMILIES", grown)
    monkeypatch.setattr(f"{__name__}.FAMILIES", grown)
    missed = [line for line in list_problems(family_lists(), grown) if "misses vit" in line]
    assert [line.split(" misses ")[0] for line in missed] == [
        "parity make-checkpoint's kinds",
        "the suites' model fixtures (parity/suites/conftest.py)",
        "parity/suites/<family>/conformance.py",
        "the mutant catalogue's groups (FAMILY_TITLES)",
        "reference_models.families.LAYOUTS",
        "reference_models.checkpoints.MAKERS",
        "reference_models.checkpoints.RELEASE_WRITERS",
    ]


def test_a_hand_written_model_fixture_is_seen(tmp_path: Path) -> None:
    """The fixtures are read from the source: a `*_models` function bypassing `family_models`
    counts as a fixture of no family."""
    conftest = tmp_path / "conftest.py"
    conftest.write_text('ar_models = family_models("ar", build)\n\n\n@pytest.fixture\ndef vit_models():\n    pass\n')
    assert fixtures_in_conftest(conftest) == {"ar_models": "ar", "vit_models": ""}

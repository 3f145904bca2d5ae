"""Several kill selections in one pytest session, each `-k` expression applied to its own file only.

The correct-target controls run every test the lane's mutants are killed with, in one session per
configuration. A single `-k` cannot say "this expression in that file": qualified by the module
name, `test_numerics and compiled` meant for `dit/test_numerics.py` also selected every compiled
test of `ar/test_numerics.py` (the same module name), and `test_numerics and reference` every AR
numerics test. This plugin (`-p parity.suites.sensitivity.selection`) takes the selections as
`--kill-selections JSON`, a list of `[file, expression or null]`, and keeps exactly the items
that some selection of their own file picks, evaluating the expression with pytest's own `-k`
matcher, so each selection means what it means when the mutant's tests run alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kill-selections",
        default=None,
        help="JSON list of [file, -k expression or null]: keep the items a selection of their own file picks",
    )


def selections_from(text: str, root: Path) -> list[tuple[Path, str | None]]:
    """The parsed option: files resolved against `root` (the session's invocation directory)."""
    return [((root / file).resolve(), expression) for file, expression in json.loads(text)]


def picks(item: pytest.Item, selections: list[tuple[Path, str | None]]) -> bool:
    """Whether a selection of `item`'s own file picks it (pytest's `-k` semantics per selection)."""
    from _pytest.mark import KeywordMatcher
    from _pytest.mark.expression import Expression

    path = Path(item.path).resolve()
    matcher = None
    for file, expression in selections:
        if file != path:
            continue
        if expression is None:
            return True
        matcher = matcher or KeywordMatcher.from_item(item)
        if Expression.compile(expression).evaluate(matcher):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    text = config.getoption("kill_selections")
    if not text:
        return
    selections = selections_from(text, Path(config.invocation_params.dir))
    keep, drop = [], []
    for item in items:
        (keep if picks(item, selections) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep

"""The report layer never parses prose back (docs/reports.md §1): decode tokens, per-step errors and
stage chains travel in a row's `data` column, so no regular expression in parity/report reads the
free-text `detail` column. The scan looks at every call that applies a pattern: `re.search(p,
detail)` and its kin, a compiled pattern's `.search(detail)`, and pandas' `.str.extract` /
`.contains` / ... on a `detail` column. Planted forms show each going red."""

from __future__ import annotations

import ast
from collections.abc import Iterator

import pytest

from tests.support.helpers import PROJECT_ROOT

REPORT = PROJECT_ROOT / "parity" / "report"
PATTERN_CALLS = {"search", "match", "fullmatch", "findall", "finditer", "sub", "subn"}  # re's and a compiled pattern's
RE_ONLY = {"split", "compile"}  # re.split(p, detail); a str's own .split is no pattern
PANDAS_STR = {"extract", "extractall", "contains", "match", "fullmatch", "findall", "replace", "split", "rsplit", "count"}


def _mentions_detail(node: ast.AST) -> bool:
    for part in ast.walk(node):
        if isinstance(part, ast.Constant) and part.value == "detail":
            return True
        if isinstance(part, ast.Name) and "detail" in part.id:
            return True
        if isinstance(part, ast.Attribute) and "detail" in part.attr:
            return True
    return False


def regex_over_detail(source: str) -> Iterator[tuple[int, str]]:
    """(line, code) of every call in `source` that applies a regular expression to `detail`."""
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, receiver = node.func.attr, node.func.value
        on_re = isinstance(receiver, ast.Name) and receiver.id == "re"
        arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
        if (
            (name in PATTERN_CALLS or (on_re and name in RE_ONLY))
            and any(map(_mentions_detail, arguments))
            or name in PANDAS_STR
            and isinstance(receiver, ast.Attribute)
            and receiver.attr == "str"
            and _mentions_detail(receiver.value)
        ):
            yield node.lineno, ast.unparse(node)


def test_no_regex_reads_detail_in_the_report_layer() -> None:
    modules = sorted(REPORT.rglob("*.py"))
    assert len(modules) > 10
    found = [
        f"{path.relative_to(PROJECT_ROOT)}:{line}: {code}"
        for path in modules
        for line, code in regex_over_detail(path.read_text())
    ]
    assert found == []


@pytest.mark.parametrize(
    "planted",
    [
        "re.search(r'tokens (\\d+)', row['detail'])",
        "_TOKEN_ROW.finditer(detail or '')",
        "re.split(r'; ', str(blame.detail))",
        "frame['detail'].str.extract(r'step (\\d+)')",
        "rows.detail.str.contains('diverged')",
        "_REPRO.sub('', text, count=1) if False else _REPRO.sub('', detail_text)",
    ],
)
def test_a_planted_regex_over_detail_is_found(planted: str) -> None:
    assert [line for line, _ in regex_over_detail(planted)] == [1]


@pytest.mark.parametrize(
    "allowed",
    [
        "detail.split(' | ', 1)",
        "detail.endswith('[rule]')",
        "re.sub(r'[^a-z]+', '-', device_name)",
        "frame['suite'].str.contains('x')",
    ],
)
def test_string_methods_and_other_columns_are_not_regex_over_detail(allowed: str) -> None:
    assert list(regex_over_detail(allowed)) == []

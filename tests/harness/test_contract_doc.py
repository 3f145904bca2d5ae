"""docs/targets.md states every requirement the suites and the conformance probes check on a target,
in the words of the check, and stays in step with them.

Three rules, read from the page and from the source (`ast`):

1. **The registry is on the page.** Every `parity.contract.Requirement` has its `words` as a
   backticked span and its `rule` verbatim (whitespace folded) in its section of docs/targets.md
   (the section runs to the next heading of the same or a higher level, so `## 3.` holds `### 3.1.`).
2. **Messages that cite the page name only what the page states.** Every string in `parity/` that
   cites docs/targets.md (docstrings left out: they document, they do not report) names each
   backticked identifier the page has in backticks, cites only sections the page has, and takes a
   requirement's words from the registry (`parity.contract`) rather than spelling them itself.
3. **Every member the suites read off a target is on the page.** In the suites and the probes, an
   attribute read (`target.x`, `adapter.x`, `models.target.x`, `site.x`, ...) or a `getattr` /
   `hasattr` by literal name on a target object names a member the page has in backticks.

The `*_fails` tests run the same rules on a doctored copy of the page (a requirement's sentence
removed) and on synthetic source (a new message, a new member read), so each rule can fail.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from parity import contract
from parity.contract import REQUIREMENTS, Requirement
from parity.target import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / contract.DOC
HEADING = re.compile(r"^(#{2,4}) (\d+(?:\.\d+)?)\. ", re.M)
SPAN = re.compile(r"`([^`\n]+)`")
CITE = re.compile(r"docs/targets\.md((?:[ ,;]*(?:and )?§\d+(?:\.\d+)?)*)")
IDENTIFIER = re.compile(r"^[A-Za-z_][\w.]*(\(.*\))?$")

# Where messages are scanned (rule 2): the whole package but the registry itself.
MESSAGE_FILES = sorted(p for p in (ROOT / "parity").rglob("*.py") if p != ROOT / "parity" / "contract.py")
# Where target members are read (rule 3): the suites that judge a target and the probes. The mutant
# modules are left out: they patch the built-in target's internals on purpose.
MEMBER_FILES = sorted(
    [
        *(p for family in FAMILIES for p in (ROOT / "parity" / "suites" / family).glob("*.py")),
        ROOT / "parity" / "suites" / "conftest.py",
        ROOT / "parity" / "suites" / "families.py",
        ROOT / "parity" / "conformance.py",
    ]
)
MEMBER_FILES = [p for p in MEMBER_FILES if p.name != "mutants.py"]
# Names that hold a target or one of its adapters (or a site or class of one) in those files.
TARGET_NAMES = frozenset({"target", "adapter", "built", "router", "site", "holder", "variant", "blended"})


# ---------------------------------------------------------------------------------------------
# Reading the page
# ---------------------------------------------------------------------------------------------


def sections(doc: str) -> dict[str, str]:
    """Section number -> its text, heading included, up to the next heading of its level or above."""
    heads = [(m.start(), len(m.group(1)), m.group(2)) for m in HEADING.finditer(doc)]
    out = {}
    for i, (start, level, number) in enumerate(heads):
        end = next((s for s, lvl, _ in heads[i + 1 :] if lvl <= level), len(doc))
        out[number] = doc[start:end]
    return out


def folded(text: str) -> str:
    return " ".join(text.split())


def spans(text: str) -> set[str]:
    return set(SPAN.findall(text))


def span_words(text: str) -> set[str]:
    """Every identifier-like word inside a backticked span (`module.make_x(batch)` -> module, make_x, batch)."""
    return {w for span in spans(text) for w in re.findall(r"[A-Za-z_]\w*", span)}


# ---------------------------------------------------------------------------------------------
# The three rules, as functions of the page's text and the sources
# ---------------------------------------------------------------------------------------------


def requirement_problems(doc: str, requirements: Iterable[Requirement]) -> list[str]:
    """Rule 1: each requirement's words (backticked) and rule (verbatim) in its section."""
    by_number, problems = sections(doc), []
    for req in requirements:
        text = by_number.get(req.section)
        if text is None:
            problems.append(f"{req.key}: docs/targets.md has no §{req.section}")
            continue
        if req.words not in spans(text):
            problems.append(f"{req.key}: §{req.section} does not state `{req.words}` (backticked)")
        if folded(req.rule) not in folded(text):
            problems.append(f"{req.key}: §{req.section} does not say {req.rule!r}")
    return problems


@dataclasses.dataclass(frozen=True)
class Message:
    where: str
    text: str  # the literal parts; interpolations as {}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def messages(source: str, where: str) -> Iterator[Message]:
    """The strings of `source` that are not docstrings: constants, and f-strings with `{}` holes."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    inside_fstring = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            yield Message(f"{where}:{node.lineno}", text)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip | inside_fstring:
            yield Message(f"{where}:{node.lineno}", node.value)


def message_problems(doc: str, found: Iterable[Message], requirements: Iterable[Requirement]) -> list[str]:
    """Rule 2, on every message that cites docs/targets.md."""
    numbers, names = set(sections(doc)), span_words(doc)
    requirements = list(requirements)
    problems = []
    for message in found:
        cites = list(CITE.finditer(message.text))
        if not cites:
            continue
        for cite in cites:
            for number in re.findall(r"§(\d+(?:\.\d+)?)", cite.group(1)):
                if number not in numbers:
                    problems.append(f"{message.where}: cites docs/targets.md §{number}, which the page lacks")
        for span in spans(message.text):
            if not IDENTIFIER.match(span):
                continue
            missing = [w for w in re.findall(r"[A-Za-z_]\w*", span.split("(")[0]) if w not in names]
            if missing:
                problems.append(f"{message.where}: names `{span}`, which docs/targets.md does not state")
        for req in requirements:
            if len(req.words) > 5 and req.words in message.text:
                problems.append(f"{message.where}: spells {req.words!r} itself; take it from parity.contract ({req.key})")
    return problems


def _is_target(node: ast.AST) -> bool:
    """`target`, `adapter`, ..., `models.target`, and the `.module` of one of them."""
    if isinstance(node, ast.Name):
        return node.id in TARGET_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr == "target" or (node.attr == "module" and _is_target(node.value))
    return False


def members_read(source: str, where: str) -> Iterator[tuple[str, str]]:
    """(member, where) for each member read off a target object in `source`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_target(node.value) and not isinstance(node.ctx, ast.Store):
            yield node.attr, f"{where}:{node.lineno}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and _is_target(node.args[0])
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            yield node.args[1].value, f"{where}:{node.lineno}"


def member_problems(doc: str, read: Iterable[tuple[str, str]]) -> list[str]:
    """Rule 3: each member read is a backticked word of the page."""
    names = span_words(doc)
    missing: dict[str, list[str]] = {}
    for member, where in read:
        if member not in names and not (member.startswith("__") and member.endswith("__")):
            missing.setdefault(member, []).append(where)
    return [f"`{m}` is read off a target ({', '.join(w[:3])}) but docs/targets.md never states it" for m, w in missing.items()]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def repo_messages() -> list[Message]:
    return [m for p in MESSAGE_FILES for m in messages(p.read_text(encoding="utf-8"), _rel(p))]


def repo_members() -> list[tuple[str, str]]:
    return [r for p in MEMBER_FILES for r in members_read(p.read_text(encoding="utf-8"), _rel(p))]


# ---------------------------------------------------------------------------------------------
# The repository as it is
# ---------------------------------------------------------------------------------------------


def test_every_requirement_is_stated_in_its_section() -> None:
    assert requirement_problems(DOC.read_text(encoding="utf-8"), REQUIREMENTS.values()) == []


def test_messages_citing_the_contract_name_only_what_it_states() -> None:
    found = repo_messages()
    assert sum("docs/targets.md" in m.text for m in found) >= 5, "the scan found no message citing the page"
    assert message_problems(DOC.read_text(encoding="utf-8"), found, REQUIREMENTS.values()) == []


def test_every_member_the_suites_read_is_on_the_page() -> None:
    read = repo_members()
    names = {m for m, _ in read}
    # the scan sees the members this page exists for (a broken scan must not pass vacuously)
    assert {"decode_graph_keys", "requires_raw_input_tokens", "select_experts", "timesteps", "moe_sites"} <= names
    assert member_problems(DOC.read_text(encoding="utf-8"), read) == []


def test_the_checks_take_their_words_from_the_registry() -> None:
    """The literals the checks look for are the registry's, and so is the compile the runners do."""
    from parity.runners.base import RunnerOptions
    from parity.suites.ar import fail_closed_cases
    from parity.suites.ar import test_fail_closed_capture as suite

    assert {
        key: REQUIREMENTS[key].words for key in ("names_the_layer", "offers_enforce_eager", "says_piecewise_is_not_a_workaround")
    } == suite.REQUIRED_PHRASES
    assert contract.words("probe_warning_text") == fail_closed_cases.PROBE_WORD
    settings = dict(part.split("=") for part in contract.words("compile_settings").split(", "))
    defaults = RunnerOptions()
    assert {name: str(getattr(defaults, name)) for name in settings} == settings


# ---------------------------------------------------------------------------------------------
# Each rule goes red
# ---------------------------------------------------------------------------------------------


def _without_lines(tmp_path: Path, *needles: str) -> str:
    """A copy of the page, written to `tmp_path` and read back, without every line holding a needle."""
    kept = [ln for ln in DOC.read_text(encoding="utf-8").splitlines(keepends=True) if not any(n in ln for n in needles)]
    copy = tmp_path / "targets.md"
    copy.write_text("".join(kept), encoding="utf-8")
    return copy.read_text(encoding="utf-8")


def test_a_doc_without_the_refusal_literal_fails(tmp_path: Path) -> None:
    doc = _without_lines(tmp_path, "`model.layers.`")
    problems = requirement_problems(doc, REQUIREMENTS.values())
    assert any(p.startswith("names_the_layer:") and "`model.layers.`" in p for p in problems), problems


def test_a_doc_saying_only_names_the_layer_fails() -> None:
    """The page as it was: the refusal "names the layer", no literal."""
    doc = DOC.read_text(encoding="utf-8").replace("`model.layers.`", "the layer")
    assert any(p.startswith("names_the_layer:") for p in requirement_problems(doc, REQUIREMENTS.values()))


def test_a_doc_without_the_every_forward_rule_fails() -> None:
    """The page as it was: `is_capturing` asked "before any host read", not on every forward."""
    rule = REQUIREMENTS["is_capturing_every_forward"].rule
    wrapped = r"\s+".join(map(re.escape, rule.split()))  # the sentence may wrap
    doc, found = re.subn(wrapped, "asked before any host read", DOC.read_text(encoding="utf-8"))
    assert found >= 1
    problems = requirement_problems(doc, [REQUIREMENTS["is_capturing_every_forward"]])
    assert problems == [
        f"is_capturing_every_forward: §{REQUIREMENTS['is_capturing_every_forward'].section} does not say {rule!r}"
    ]


def test_a_doc_without_decode_graph_keys_fails(tmp_path: Path) -> None:
    doc = _without_lines(tmp_path, "decode_graph_keys")
    assert any(p.startswith("decode_graph_keys:") for p in requirement_problems(doc, REQUIREMENTS.values()))
    problems = member_problems(doc, repo_members())
    assert any(p.startswith("`decode_graph_keys` is read off a target") for p in problems), problems


def test_a_doc_without_the_compile_settings_fails(tmp_path: Path) -> None:
    doc = _without_lines(tmp_path, "`fullgraph=True, dynamic=True`")
    assert any(p.startswith("compile_settings:") for p in requirement_problems(doc, REQUIREMENTS.values()))


SYNTHETIC = '''
def test_chunked_prefill(ar_models, report):
    """A docstring may mention `prefill_chunks` (docs/targets.md §3): it documents, it does not report."""
    if not getattr(ar_models.target, "prefill_chunks", None):
        pytest.skip(f"the {ar_models.target.name} target declares no `prefill_chunks` (docs/targets.md §3)")
    report.verdict(rule, detail="the refusal must hold 'PIECEWISE is not a workaround' (docs/targets.md §3.1)")
    report.verdict(rule, detail="see docs/targets.md §NO_SUCH_SECTION")
'''.replace("NO_SUCH_SECTION", "13")  # spelt at run time: the citation check (tests/repo/test_docs.py) reads this file


def test_a_message_naming_a_requirement_the_doc_lacks_fails() -> None:
    doc = DOC.read_text(encoding="utf-8")
    problems = message_problems(doc, messages(SYNTHETIC, "synthetic.py"), REQUIREMENTS.values())
    assert problems == [
        "synthetic.py:5: names `prefill_chunks`, which docs/targets.md does not state",
        "synthetic.py:6: spells 'PIECEWISE is not a workaround' itself; take it from parity.contract "
        "(says_piecewise_is_not_a_workaround)",
        f"synthetic.py:7: cites docs/targets.md §{13}, which the page lacks",
    ]


def test_a_member_read_the_doc_lacks_fails() -> None:
    problems = member_problems(DOC.read_text(encoding="utf-8"), members_read(SYNTHETIC, "synthetic.py"))
    assert problems == ["`prefill_chunks` is read off a target (synthetic.py:4) but docs/targets.md never states it"]


@pytest.mark.parametrize("key", sorted(REQUIREMENTS))
def test_each_requirement_is_needed_by_the_page(key: str, tmp_path: Path) -> None:
    """Dropping the lines that carry a requirement's words from its section makes rule 1 fail."""
    req = REQUIREMENTS[key]
    doc = _without_lines(tmp_path, f"`{req.words}`")
    assert any(p.startswith(f"{key}:") for p in requirement_problems(doc, [req]))

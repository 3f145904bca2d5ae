"""Every document the code cites is in the repository: docs/ pages and sections that exist, no
document that lives elsewhere (a reader of the repo could not follow it).

Scanned: every tracked (or new, not ignored) *.py, *.toml and *.md file, whole text, so comments,
docstrings, messages and case-file reasons are all covered. A citation is `docs/<page>.md`,
optionally followed by sections `§N` / `§N.M` (a heading `## N.` / `### N.M` of that page) or
routing rules `RN` (a row of that page's rule table). Inside docs/ a Markdown link
`[page.md](page.md) §N` is a citation of that page.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
THIS_FILE = Path(__file__).resolve()

# Documents outside the repository, and internal names of bug reports instead of the upstream
# issue they are about. Each entry: (pattern, what to cite instead).
EXTERNAL = [
    (r"\bpractice\.md\b", "docs/tolerances.md, docs/capture-and-compile.md or docs/images.md"),
    (r"\bmoe_routing\.md\b", "docs/routing.md"),
    (r"\bmammothmoda2\.md\b", "docs/model.md"),
    (r"\bDESIGN\.md\b", "README.md or docs/"),
    (r"\bSUITES\.md\b", "README.md or docs/"),
    (r"\bSTYLE\.md\b", "CONTRIBUTING.md"),
    (r"\.\./shared\b|\bshared/(spec|seeds)\b", "docs/"),
    (r"\bspec/", "docs/"),
    (r"\bspec(?:[ -]§|[ -]\d|'s\b| section\b)", "docs/<page>.md §N"),
    (r"\bseed[ -]0\d\d\b", "the upstream issue the bug report is about (e.g. vllm-project/vllm-omni#7455)"),
    (r"\bissue \d+\b", "the upstream issue by owner/repo#number"),
    (r"\b(first|second|next) round\b", "what the code does, not when it was written"),
]

_REFS = r"((?:[ ,;]*(?:and )?(?:§\d+(?:\.\d+)?(?:-§\d+)?|R\d(?:-R\d)?))*)"
CITATION = re.compile(r"docs/([\w.-]+\.md)" + _REFS)
LINK = re.compile(r"\]\(([\w.-]+\.md)\)" + _REFS)
SECTION = re.compile(r"§(\d+(?:\.\d+)?)")
RULE = re.compile(r"R(\d)")


def scanned_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.toml", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).is_file() and (ROOT / name).resolve() != THIS_FILE]


@dataclass(frozen=True)
class Page:
    sections: frozenset[str]
    rules: frozenset[str]


def read_page(path: Path) -> Page:
    text = path.read_text(encoding="utf-8")
    sections = frozenset(m.group(1) for m in re.finditer(r"^#{2,4} (\d+(?:\.\d+)?)\. ", text, re.M))
    rules = frozenset(m.group(1) for m in re.finditer(r"^\| R(\d) ", text, re.M))
    return Page(sections, rules)


def _expand(refs: str, pattern: re.Pattern[str]) -> list[str]:
    """`§4-§6` -> 4, 5, 6; `R2-R4` -> 2, 3, 4; `§3.1` stays."""
    out: list[str] = []
    for chunk in re.split(r"[ ,;]+|and", refs):
        numbers = pattern.findall(chunk)
        if len(numbers) == 2 and "." not in numbers[0] + numbers[1]:
            out += [str(n) for n in range(int(numbers[0]), int(numbers[1]) + 1)]
        else:
            out += numbers
    return out


def citation_problems(path: Path, text: str, pages: dict[str, Page]) -> list[str]:
    """Every problem of one file's citations, as `file:line: message`."""
    problems = []
    in_docs = path.parent == DOCS
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{path.relative_to(ROOT)}:{number}"
        for pattern, instead in EXTERNAL:
            match = re.search(pattern, line)
            if match:
                problems.append(f"{where}: cites {match.group(0)!r}, a document outside the repository; cite {instead}")
        cited = [(m.group(1), m.group(2), m.start(), m.end()) for m in CITATION.finditer(line)]
        if in_docs:
            cited += [(m.group(1), m.group(2), m.start(), m.end()) for m in LINK.finditer(line)]
        for page_name, refs, _, _ in cited:
            page = pages.get(page_name)
            if page is None:
                problems.append(f"{where}: cites docs/{page_name}, which does not exist")
                continue
            for section in _expand(refs, SECTION):
                if section not in page.sections:
                    problems.append(f"{where}: cites docs/{page_name} §{section}, which has no heading '{section}.'")
            for rule in _expand(refs, RULE):
                if rule not in page.rules:
                    problems.append(f"{where}: cites docs/{page_name} R{rule}, which its rule table does not define")
        # A `§N` outside those citations: inside docs/ it is a section of the page itself; elsewhere
        # it must say which page it is in (write docs/<page>.md §N on the same line).
        covered = [(start, end) for _, _, start, end in cited]
        for match in SECTION.finditer(line):
            if any(start <= match.start() < end for start, end in covered):
                continue
            if not in_docs:
                problems.append(f"{where}: '§' without the docs page it refers to (write docs/<page>.md §N)")
            elif match.group(1) not in pages[path.name].sections:
                problems.append(f"{where}: §{match.group(1)} of this page has no heading '{match.group(1)}.'")
    return problems


def all_pages() -> dict[str, Page]:
    return {path.name: read_page(path) for path in DOCS.glob("*.md")}


def test_every_citation_points_inside_the_repository() -> None:
    pages = all_pages()
    problems = []
    for path in scanned_files():
        problems += citation_problems(path, path.read_text(encoding="utf-8", errors="replace"), pages)
    assert problems == [], "\n".join(problems)


def test_docs_index_lists_every_page() -> None:
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    missing = [path.name for path in DOCS.glob("*.md") if path.name != "README.md" and f"]({path.name})" not in index]
    assert missing == [], f"docs/README.md does not list {missing}"


# ---- the check goes red on each kind of bad citation --------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("# the near-tie rule (practice.md §2)", "outside the repository"),
        ('reason = "moe_routing.md §2: |dw| <= 2e-5"', "outside the repository"),
        ('"""Init (spec 6.1): seeded normal"""', "outside the repository"),
        ("# (spec §4.5)", "outside the repository"),
        ("# rows (SUITES.md): one per point", "outside the repository"),
        ("# see ../shared/spec/mammothmoda2.md", "outside the repository"),
        ("# the seed-002 defects", "outside the repository"),
        ("# seed 000: the graph-safe blend", "outside the repository"),
        ("# added in issue 14", "outside the repository"),
        ("# grew in the first round", "outside the repository"),
        ("# see docs/nonexistent.md §1", "does not exist"),
        ("# see docs/routing.md §12", "has no heading '12.'"),
        ("# see docs/routing.md §4-§11", "has no heading '10.'"),
        ("# see docs/routing.md R9", "rule table does not define"),
        ("# weights within §2 of the rules", "without the docs page"),
    ],
)
def test_a_bad_citation_is_reported(line: str, expected: str) -> None:
    problems = citation_problems(ROOT / "parity" / "example.py", line, all_pages())
    assert problems and any(expected in problem for problem in problems), problems


@pytest.mark.parametrize(
    "line",
    [
        "# pad rows (docs/routing.md §4, ROCm/ATOM#2725)",
        "# docs/routing.md §4-§6 and R2-R4",
        "# docs/tolerances.md §2: the noise floor; docs/model.md §7",
        "# the rules of docs/routing.md R1-R8",
        "# a graph captured on zeros (vllm-project/vllm-omni#7318)",
        "# see docs/capture-and-compile.md",
    ],
)
def test_a_good_citation_passes(line: str) -> None:
    assert citation_problems(ROOT / "parity" / "example.py", line, all_pages()) == []


def test_links_inside_docs_are_checked_too() -> None:
    pages = all_pages()
    assert citation_problems(DOCS / "example.md", "see [routing.md](routing.md) §4", pages) == []
    (problem,) = citation_problems(DOCS / "example.md", "see [routing.md](routing.md) §14", pages)
    assert "has no heading '14.'" in problem
    # a bare section inside a docs page is a section of that page
    assert citation_problems(DOCS / "routing.md", "as in §4 and §6", pages) == []
    (problem,) = citation_problems(DOCS / "routing.md", "as in §4 and §16", pages)
    assert "§16 of this page" in problem

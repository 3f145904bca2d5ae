"""The architecture, pinned: which package may import which, and no import cycles.

Read from the source with `ast` (every `import` and `from ... import`, including those inside
functions), so a lazy import cannot slip past. The rules:

- the harness core (`parity` outside `parity.suites` and `parity.tools`) imports no model package,
  and names none in an import string except the built-in targets' specs (`parity.target.BUILTIN_TARGETS`);
- the model tools (`parity.tools`: make and inspect checkpoints) import `reference_models` only,
  and only the command line imports them;
- every family registry on the model side is keyed like `parity.target.FAMILIES` (tests/repo/test_families.py);
- inside the core, `compare` and `observe` use nothing else of parity, `runners` only `observe`,
  `report` only `compare` (and `parity.env`, and `parity.target` for the family record), and
  `parity.target` nothing of parity;
- `serving_models` imports neither `reference_models` nor `parity` (a real engine would not), and
  `reference_models` imports neither `serving_models` nor `parity`;
- the suites reach the built-in target only through the target interface: only the mutant
  modules (which patch it on purpose) import `serving_models`;
- no two modules import each other, directly or through others (module-level imports).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("parity", "reference_models", "serving_models")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    is_package = MODULES[module].name == "__init__.py"
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, *, top_level_only: bool = False) -> Iterator[str]:
    """Every module `module` imports (for `from a import b`, `a.b` when that is a module, else `a`)."""
    tree = ast.parse(MODULES[module].read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            found = False
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    found = True
                    yield f"{target}.{alias.name}"
            if not found:
                yield target


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(rule) -> list[str]:
    return [
        f"{module} imports {imported}" for module in sorted(MODULES) for imported in imports_of(module) if rule(module, imported)
    ]


def _core(module: str) -> bool:
    return _inside(module, "parity") and not _inside(module, "parity.suites") and not _inside(module, "parity.tools")


def _is_model(name: str) -> bool:
    return _inside(name, "reference_models") or _inside(name, "serving_models")


def test_the_harness_core_imports_no_model() -> None:
    assert _violations(lambda module, imported: _core(module) and _is_model(imported)) == []


def model_strings(module: str) -> Iterator[str]:
    """Every string constant of `module` that names a model module ("pkg.mod" or "pkg.mod:attr")."""
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_model(node.value.split(":")[0]):
            yield node.value


def test_the_harness_core_names_no_model_in_an_import_string() -> None:
    """An import string is an import the first rule cannot see; the built-in targets' specs are the
    one kind allowed (they name a target as `--target` does)."""
    from parity.target import BUILTIN_TARGETS

    found = [f"{m} names {text!r}" for m in sorted(MODULES) if _core(m) for text in model_strings(m)]
    assert [line for line in found if line.split(" names ")[1].strip("'") not in BUILTIN_TARGETS.values()] == []


def test_the_model_tools_import_only_the_reference_and_only_the_command_line_imports_them() -> None:
    def rule(module: str, imported: str) -> bool:
        if _inside(module, "parity.tools"):
            return _inside(imported, "serving_models")
        return _inside(imported, "parity.tools") and module != "parity.cli" and not _inside(module, "parity.tools")

    assert _violations(rule) == []


CORE_ALLOWED = {
    "parity.compare": ("parity.compare",),
    "parity.observe": ("parity.observe",),
    "parity.runners": ("parity.runners", "parity.observe"),
    "parity.report": ("parity.report", "parity.compare", "parity.env", "parity.target"),
    "parity.target": ("parity.target",),
}


@pytest.mark.parametrize("package", sorted(CORE_ALLOWED))
def test_core_packages_depend_one_way(package: str) -> None:
    def rule(module: str, imported: str) -> bool:
        if not _inside(module, package) or not _inside(imported, "parity"):
            return False
        return not any(_inside(imported, allowed) for allowed in CORE_ALLOWED[package])

    assert _violations(rule) == []


def test_model_trees_do_not_import_each_other_or_the_harness() -> None:
    def rule(module: str, imported: str) -> bool:
        if _inside(module, "serving_models"):
            return _inside(imported, "reference_models") or _inside(imported, "parity")
        if _inside(module, "reference_models"):
            return _inside(imported, "serving_models") or _inside(imported, "parity")
        return False

    assert _violations(rule) == []


def test_suites_reach_the_built_in_target_only_through_the_target_interface() -> None:
    def rule(module: str, imported: str) -> bool:
        return _inside(module, "parity.suites") and not module.endswith(".mutants") and _inside(imported, "serving_models")

    assert _violations(rule) == []


def test_no_import_cycles() -> None:
    graph = {m: {i for i in imports_of(m) if i in MODULES and i != m} for m in MODULES}
    # a package's __init__ importing its own submodules is how re-exports work, not a cycle
    for module, targets in graph.items():
        if MODULES[module].name == "__init__.py":
            graph[module] = {t for t in targets if not _inside(t, module)}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_rules_see_a_lazy_model_import_in_the_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scanner itself: a model import inside a function of a core module is found."""
    fake = tmp_path / "sneaky.py"
    fake.write_text("def f():\n    from serving_models.ar import model\n    return model\n")
    monkeypatch.setitem(MODULES, "parity.sneaky", fake)
    with pytest.raises(AssertionError, match="parity.sneaky imports serving_models.ar.model"):
        test_the_harness_core_imports_no_model()


def test_the_rules_see_a_model_import_string_in_the_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The string scanner: `importlib.import_module("reference_models...")` in a core module is found,
    as the checkpoint inspector's strings were before it moved to the tools layer."""
    fake = tmp_path / "stringly.py"
    fake.write_text('import importlib\nLAYOUTS = "reference_models.families"\n')
    monkeypatch.setitem(MODULES, "parity.stringly", fake)
    with pytest.raises(AssertionError, match="parity.stringly names 'reference_models.families'"):
        test_the_harness_core_names_no_model_in_an_import_string()


def test_the_rules_see_a_core_module_import_the_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "reach.py"
    fake.write_text("def f():\n    from parity.tools import inspect_checkpoint\n")
    monkeypatch.setitem(MODULES, "parity.reach", fake)
    with pytest.raises(AssertionError, match="parity.reach imports parity.tools.inspect_checkpoint"):
        test_the_model_tools_import_only_the_reference_and_only_the_command_line_imports_them()

"""Every file, command-line option and case table the documentation names in backticks exists.

Scanned: README.md, CHANGELOG.md and docs/*.md, inline code spans only (fenced blocks are
commands and output, checked by running them). Three kinds of reference:

- a path: a word of a span with a `/` or a known file extension (`docs/cli.md`,
  `parity/suites/ar/test_decode.py`, `cpu-fp32.csv`). It must name a file or directory of the
  repository (tracked, or new and not ignored, as a fresh clone has them), taken from the root, from
  the page's own directory, or as the tail of a repository path (the suite table's module column
  is relative to `parity/suites/`). `<placeholder>` parts and `*` match anything; a word in
  capitals (`RUN_DIR/review/`) is a placeholder of a command's synopsis and is not checked; files a
  run writes and example names are in `NOT_IN_REPOSITORY`,
  upstream projects' files in `UPSTREAM`.
- an option `--name`: an option of `parity`'s commands (`parity.cli.build_parser`), of the pytest
  plugin (`parity.plugin.options`), or one of `OTHER_OPTIONS` (pytest's, pip's, with the reason).
- a case table: a span `[table]` / `[[table]]` (optionally followed by a key), and a name cited as
  `` `name` in `cases/<family>.toml` ``: it must be a table (or key) of the case files in `cases/`.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

EXTENSIONS = ("py", "toml", "md", "csv", "json", "html", "png", "txt", "yml", "yaml", "cfg", "sh", "whl", "safetensors")

# Files and directories a run or a command writes, and example names of files a user makes:
# named by the docs, absent from a clone.
NOT_IN_REPOSITORY = {
    "reports/runs": "where every run directory goes (ignored by git)",
    "results.csv": "a run's rows",
    "run.json": "a run's environment and status",
    "index.html": "a run's review page",
    "review": "the review page's figures, inside a run directory",
    "numerics-*.png": "a review page figure (review/)",
    "image-diff-*.png": "a review page figure (review/)",
    "images": "a run's generated images, inside a run directory",
    "benchmark": "the benchmarks' profiles, inside a run directory",
    ".parity-review": "the list of files parity wrote into review/",
    "repro": "a failing case's standalone repro, inside a run directory (repro/<case>-<mode>/)",
    "calls.json": "a repro's calls (inside repro/<case>-<mode>/)",
    "inputs.safetensors": "a repro's inputs (inside repro/<case>-<mode>/)",
    "weights.safetensors": "a repro's weights (inside repro/<case>-<mode>/)",
    "calls.pt": "the pickle older repros held, refused by the replay",
    "config.json": "a checkpoint's configuration (make-checkpoint writes it)",
    "model.safetensors": "a checkpoint's tensors (make-checkpoint writes them)",
    "model.safetensors.index.json": "a sharded checkpoint's index",
    "cpu-fp32-reference.csv": "the baseline --write-baseline names for --target reference",
    "cpu-fp32-my_engine.parity_target-make_target.csv": "an example of a custom target's baseline name",
    "selfchek.toml": "the misspelt case file of an example error message",
    ".venv": "the virtual environment the set-up commands create",
}

# Files of upstream projects the docs cite beside the project's name.
UPSTREAM = {
    "mamoda2/mammothmoda2/utils/t2i_utils.py": "MammothModa2's release code",
    "mammothmoda2_dit/": "MammothModa2's release code",
    "test_dit_compile_parity.py": "vLLM-Omni's tests",
    "test_dit_attention_cuda.py": "vLLM-Omni's tests",
    "tests/model_ops/test_k3_grouped_topk.py": "ROCm/ATOM's tests",
    "test_k3_grouped_topk.py": "ROCm/ATOM's tests",
    "tests/model_ops/test_shared_expert_dispatch.py": "ROCm/ATOM's tests",
    "tests/model_ops/test_shared_expert_dispatch_triton.py": "ROCm/ATOM's tests",
    "tests/test_eplb_module_a.py": "ROCm/ATOM's tests",
    "tests/kernels/moe/test_topk_softplus_sqrt.py": "vLLM's tests",
    "test_topk_softplus_sqrt.py": "vLLM's tests",
    "moe_routing/topk.py": "AITER's Triton routing",
    "benchmarks/dynamo/common.py": "pytorch/pytorch's accuracy benchmarks",
    "torch/utils/_contextlib.py": "PyTorch's context-manager decorators (torch.no_grad's decorate_context)",
}

# Options that are not parity's, and why the docs name them.
OTHER_OPTIONS = {
    "--pyargs": "pytest: collect tests from an installed package (parity.suites)",
    "--durations": "pytest: the slowest tests, to see where a run's time goes",
    "--maxfail": "pytest: stop after N failures (a run recorded as interrupted)",
    "--co": "pytest: collect only, list the tests a selection picks (the plugin's import cost is measured on it)",
    "--markdown": "python -m parity.suites.sensitivity.catalogue: print docs/mutants.md",
}

SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
TABLE_SPAN = re.compile(r"^\[\[?([A-Za-z_][\w.]*)\]\]?(?:\s+([A-Za-z_]\w*))?$")
CITED_IN_CASES = re.compile(r"`([A-Za-z_][\w.]*)`\s+(?:in|of|from)\s+`cases/(\w+)\.toml`")
PATH_WORD = re.compile(r"^[\w.<>*-]+(?:/[\w.<>*-]*)+$|^[\w.<>*-]+\.(?:" + "|".join(EXTENSIONS) + r")$")


def scanned_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]


@cache
def repository_paths() -> frozenset[str]:
    """Every file of the repository and every directory above one, as a fresh clone has them."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    paths: set[str] = set()
    for name in listed:
        if not (ROOT / name).exists():  # deleted in the working tree
            continue
        parts = name.split("/")
        paths.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(paths)


def _glob(word: str) -> re.Pattern[str]:
    pattern = re.escape(word).replace(r"\*", "[^/]*")
    pattern = re.sub(r"<[^>]*>", "[^/]+", pattern.replace(r"\<", "<").replace(r"\>", ">"))
    return re.compile(pattern)


def path_exists(word: str, page_dir: str) -> bool:
    if word in UPSTREAM:
        return True
    word = word.rstrip("/")
    if word in NOT_IN_REPOSITORY or any(word.startswith(f"{prefix}/") for prefix in NOT_IN_REPOSITORY):
        return True
    patterns = [_glob(word)] + ([_glob(f"{page_dir}/{word}")] if page_dir else [])
    depth = word.count("/")
    for path in repository_paths():
        if any(pattern.fullmatch(path) for pattern in patterns):
            return True
        if path.count("/") > depth and patterns[0].fullmatch(path.split("/", path.count("/") - depth)[-1]):
            return True  # the tail of a repository path
    return False


def _has_extension(word: str) -> bool:
    return re.search(r"\.(?:" + "|".join(EXTENSIONS) + r")$", word) is not None


@cache
def _directory_names() -> frozenset[str]:
    """The name of every directory of the repository (a path's first part names one), and `*`/`<x>`."""
    files = repository_paths()
    names = {part for path in files for part in path.split("/")[:-1]}
    return frozenset(names | {name.split("/")[0] for name in NOT_IN_REPOSITORY} | {"*"})


def _is_placeholder(word: str) -> bool:
    return any(re.fullmatch(r"[A-Z][A-Z_]*", part) for part in word.split("/")) or word.startswith("path/to/")


def path_words(span: str) -> list[str]:
    words = []
    for raw in re.sub(r"<[^>]*>", "*", span).split():
        word = raw.strip(".,;:()'\"").split("::")[0]
        if "://" in raw or "#" in word or not PATH_WORD.match(word) or _is_placeholder(word):
            continue
        if re.fullmatch(r"[\d./]+", word):  # 1/2, 0.20
            continue
        if word.startswith("*.") or not re.search(r"[A-Za-z]", re.sub(r"\.(?:" + "|".join(EXTENSIONS) + r")\b", "", word)):
            continue  # `*.safetensors`, `*-*.csv`: a pattern of names, not a reference
        if not (word.endswith("/") or _has_extension(word) or word.split("/")[0] in _directory_names()):
            continue  # `atol/10`, `max/mean`: a formula, not a path
        words.append(word)
    return words


@cache
def known_options() -> frozenset[str]:
    from parity.cli import build_parser
    from parity.plugin.options import PYTEST_PREFIX, add_run_options

    options: set[str] = set()
    parsers = [build_parser()]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            options.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
    add_run_options(lambda flag, **_: options.add(flag), PYTEST_PREFIX)
    plugin_source = (ROOT / "parity" / "plugin" / "options.py").read_text(encoding="utf-8")
    options.update(re.findall(r"\"(--parity-[\w-]+)\"", plugin_source))  # addoption outside RUN_OPTIONS
    return frozenset(options)


@cache
def torchrun_options() -> frozenset[str]:
    """The options of torch's launcher (`torchrun`), from its own parser."""
    from torch.distributed.run import get_args_parser

    return frozenset(option for action in get_args_parser()._actions for option in action.option_strings)


@cache
def case_files() -> dict[str, dict[str, Any]]:
    return {path.stem: tomllib.loads(path.read_text(encoding="utf-8")) for path in sorted((ROOT / "cases").glob("*.toml"))}


def _lookup(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if isinstance(data, list):
            data = data[0] if data else {}
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _keys_anywhere(data: Any) -> set[str]:
    if isinstance(data, list):
        return set().union(*(_keys_anywhere(item) for item in data)) if data else set()
    if isinstance(data, dict):
        return set(data).union(*(_keys_anywhere(value) for value in data.values())) if data else set()
    return set()


def table_problem(table: str, key: str | None, family: str | None = None) -> str | None:
    files = case_files()
    if family is not None and family not in files:
        return f"`cases/{family}.toml` does not exist"
    searched = {family: files[family]} if family is not None else files
    where = f"cases/{family}.toml" if family else "any of cases/*.toml"
    for data in searched.values():
        found = _lookup(data, table)
        if found is None:
            continue
        if key is not None and key not in _keys_anywhere(found):
            return f"table [{table}] has no key `{key}`"
        return None
    return f"no table or key `{table}` in {where}"


def reference_problems(page: str, text: str, page_dir: str = "") -> list[str]:
    """Every reference of one page that names nothing, as `page:line: message`."""
    problems = []
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{page}:{number}"
        for span in SPAN.findall(line):
            table = TABLE_SPAN.match(span.strip())
            if table:
                problem = table_problem(table.group(1), table.group(2))
                if problem:
                    problems.append(f"{where}: `{span}`: {problem}")
                continue
            for word in path_words(span):
                if not path_exists(word, page_dir):
                    problems.append(f"{where}: `{span}`: no file or directory {word!r} in the repository")
            launcher, _, rest = span.partition(" -m ") if span.startswith("torchrun ") else ("", "", span)
            for option in OPTION.findall(launcher):  # `torchrun --nnodes 2 ... -m parity run ...`: torchrun's own
                if option not in torchrun_options():
                    problems.append(f"{where}: `{span}`: {option} is no option of torchrun (torch.distributed.run)")
            for option in OPTION.findall(rest):
                if option.endswith("-"):  # `--parity-<name>`: the prefix, not an option
                    continue
                if option not in known_options() and option not in OTHER_OPTIONS:
                    problems.append(f"{where}: `{span}`: {option} is no option of parity, its plugin or OTHER_OPTIONS")
        for name, family in CITED_IN_CASES.findall(line):
            problem = table_problem(name, None, family) if "." in name else _name_problem(name, family)
            if problem:
                problems.append(f"{where}: `{name}` in `cases/{family}.toml`: {problem}")
    return problems


def _name_problem(name: str, family: str) -> str | None:
    files = case_files()
    if family not in files:
        return f"`cases/{family}.toml` does not exist"
    return None if name in _keys_anywhere(files[family]) else f"no table or key `{name}` in cases/{family}.toml"


@pytest.mark.parametrize("page", scanned_pages(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_reference_names_something_that_exists(page: Path) -> None:
    page_dir = str(page.parent.relative_to(ROOT)) if page.parent != ROOT else ""
    problems = reference_problems(str(page.relative_to(ROOT)), page.read_text(encoding="utf-8"), page_dir)
    assert problems == [], "\n".join(problems)


def test_the_allow_lists_name_only_what_parity_does_not_define() -> None:
    assert not set(OTHER_OPTIONS) & known_options(), "an allow-listed option is parity's own: take it off the list"
    tracked = repository_paths()
    assert not [name for name in NOT_IN_REPOSITORY if name in tracked], "a listed name is in the repository: take it off"
    assert not [name for name in UPSTREAM if name.rstrip("/") in tracked], "an upstream path is in the repository: take it off"


# ---- the check goes red on each kind of stale reference -------------------------------------------


EXAMPLE_PAGE = str((DOCS / "example.md").relative_to(ROOT))  # a page of docs/ that does not exist


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("The rules: `examples/nonexistent.md`.", "no file or directory 'examples/nonexistent.md'"),
        ("The module `parity/report/nowhere.py` writes it.", "no file or directory"),
        ("Run `parity run --no-such-option`.", "--no-such-option is no option"),
        ("Pass `--parity-colour red` to pytest.", "--parity-colour is no option"),
        ("Launch `torchrun --nodes 2 -m parity run --tp 2`.", "--nodes is no option of torchrun"),
        ("Launch `torchrun --nnodes 2 -m parity run --tps 2`.", "--tps is no option of parity"),
        ("The bound of `[tolerances.graph_vs_eager_bf16]`.", "no table or key `tolerances.graph_vs_eager_bf16`"),
        ("Set `[decode_settings] no_such_key`.", "has no key `no_such_key`"),
        ("the bf16 pair (`graph_vs_eager_bf16` in `cases/ar.toml`)", "no table or key `graph_vs_eager_bf16`"),
        ("its prompts (`prompts` in `cases/nothing.toml`)", "does not exist"),
    ],
)
def test_a_stale_reference_is_reported(line: str, expected: str) -> None:
    problems = reference_problems(EXAMPLE_PAGE, line, "docs")
    assert problems and any(expected in problem for problem in problems), problems


@pytest.mark.parametrize(
    "line",
    [
        "See `tolerances.md` (a page beside this one) and `examples/minimal_target/parity_target.py`.",
        "The suite module `ar/test_decode.py` (under `parity/suites/`), the mutants in `parity/suites/<family>/mutants.py`.",
        "A run writes `reports/runs/<run_id>/` with `results.csv`; figures go to `RUN_DIR/review/`.",
        "`parity run --target x --suite numerics -n 2` and `pytest --pyargs parity.suites --parity-device cuda`",
        "`torchrun --nnodes 2 --nproc-per-node 8 --standalone -m parity run --tp 16 --shard 1/2`",
        "The bound `[tolerances.graph_vs_eager_fp32]`, `[decode_settings] bucket_steps`, `[[prompts]]`.",
        "the fp32 bound (`graph_vs_eager_fp32` in `cases/ar.toml`)",
        "upstream `vllm-project/vllm-omni#7318`, a ratio of `1/sqrt(fan_in)`, `cases/*.toml`",
        "```bash\nparity run --made-up-in-a-fence\n```",
    ],
)
def test_a_good_reference_passes(line: str) -> None:
    assert reference_problems(EXAMPLE_PAGE, line, "docs") == []

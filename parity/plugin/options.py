"""The run options, defined once for the pytest plugin (`--parity-device`) and `parity run` (`--device`).

Every option is a row of `RUN_OPTIONS`; `add_run_options(add, prefix)` declares them through any
`addoption`-like callable (pytest's option group with prefix `parity-`, an argparse parser with
no prefix), so the plugin and the command line cannot drift apart. `pytest_args(values)` turns
`parity run`'s parsed values back into the plugin's spelling.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from parity.cases import check_safe_name, defer_errors

PYTEST_PREFIX = "parity-"
ENTRY_POINT = ("parity", "parity.plugin")  # the pytest11 entry point: name, module
DEVICES = ("cpu", "cuda")
SIZES = ("tiny", "full")
DTYPES = ("fp32", "bf16", "fp16")
DEFAULT_DTYPE = {"cpu": "fp32", "cuda": "bf16"}
LAYOUTS = ("parity", "release")


MAX_SEED_OFFSET = 2**31 - 1  # added to case seeds, which must stay in numpy's 32-bit range


def check_seed(seed: int, option: str = "--seed") -> int:
    """`seed` if it is a usable offset of every case seed (0 .. 2**31 - 1), else a ValueError."""
    if not 0 <= seed <= MAX_SEED_OFFSET:
        raise ValueError(f"{option} {seed}: expected an integer in [0, {MAX_SEED_OFFSET}]".strip())
    return seed


def check_run_id(run_id: str, option: str = "--run-id") -> str:
    """`run_id` if it is a safe directory name (`parity.cases.SAFE_NAME`: it must not leave the
    report directory), else a ValueError naming the option and the rule."""
    return check_safe_name(run_id, option)


def directory_name(value: str) -> str:
    """An argparse `type`: a directory option's value, refused when empty (an empty string is no
    directory, and reading it as "the default" would write where the user did not say)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(
            f"{value!r} is an empty directory name: give a directory (an option left out takes its default)"
        )
    return value


def workers(value: str) -> str:
    """An argparse `type`: pytest-xdist's `-n` (a non-negative number of workers, `auto` or `logical`)."""
    if value in ("auto", "logical") or value.isdigit():
        return value
    raise argparse.ArgumentTypeError(f"expected a non-negative number of workers, 'auto' or 'logical', got {value!r}")


def seed_option(value: str) -> int:
    """An argparse `type`: a seed offset (`check_seed`'s range)."""
    try:
        seed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
    try:
        return check_seed(seed, "")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None


def options_set_behind_parity_run(pytest_arguments: list[str]) -> list[str]:
    """The `--parity-*` options among pytest arguments given after `parity run --`: parity run sets
    each of them from its own option (and reads the run directory they name), so one given behind its
    back would send rows where parity run does not look."""
    own = {option.flag(PYTEST_PREFIX): option.flag("") for option in RUN_OPTIONS}
    own["--parity-no-summary"] = ""
    found = []
    for argument in pytest_arguments:
        flag = argument.split("=", 1)[0]
        if flag in own:
            found.append(f"{flag} (give {own[flag]} to parity run)" if own[flag] else f"{flag} (parity run sets it)")
    return found


@dataclasses.dataclass(frozen=True)
class RunOption:
    """One run option: its name without prefix, and the argparse keywords that declare it."""

    name: str
    kwargs: Mapping[str, Any]

    def flag(self, prefix: str) -> str:
        return f"--{prefix}{self.name}"

    def dest(self, prefix: str) -> str:
        return f"{prefix}{self.name}".replace("-", "_")


RUN_OPTIONS: tuple[RunOption, ...] = (
    RunOption("device", dict(choices=DEVICES, default="cpu", help="device the suites run on (default: cpu)")),
    RunOption("size", dict(choices=SIZES, default="tiny", help="model configuration size (default: tiny)")),
    RunOption(
        "dtype",
        dict(choices=DTYPES, default=None, help="dtype of the target under test (default: fp32 on cpu, bf16 on cuda)"),
    ),
    RunOption(
        "target",
        dict(
            default="serving",
            help=(
                "implementation under test: serving (built-in), reference, or package.module:factory "
                "(imports and runs that module's code, as any plugin would; default: serving)"
            ),
        ),
    ),
    RunOption(
        "tp",
        dict(
            type=int,
            default=1,
            metavar="N",
            help=(
                "tensor-parallel size: run the target sharded over N ranks (one pytest session each, gloo on "
                "cpu, NCCL on N GPUs); the factory gets tp=(rank, world_size, group) (default: 1)"
            ),
        ),
    ),
    RunOption(
        "shard",
        dict(
            default=None,
            metavar="K/N",
            help=(
                "run only the K-th of N deterministic, cost-balanced parts of the selection (a model family's "
                "shared compiles and each case kept whole), for N machines whose runs `parity merge` joins"
            ),
        ),
    ),
    RunOption(
        "report-dir",
        dict(
            default=None,
            type=directory_name,
            metavar="DIR",
            help="directory that receives one run directory per run (default: ./reports/runs)",
        ),
    ),
    RunOption(
        "run-id",
        dict(
            default=None,
            help=(
                "name of this run's directory (default: UTC timestamp + random suffix); letters, digits, '.', '_', '-'. "
                "An existing run is refused unless --overwrite or --append"
            ),
        ),
    ),
    RunOption(
        "overwrite",
        dict(action="store_true", default=False, help="replace the run directory of --run-id if it already holds a run"),
    ),
    RunOption(
        "append",
        dict(
            action="store_true",
            default=False,
            help="add this session's rows to the existing run of --run-id (same device, size, dtype, target and seed)",
        ),
    ),
    RunOption(
        "checkpoint-layout",
        dict(
            choices=LAYOUTS,
            default="parity",
            help=(
                "layout of the tiny checkpoints the suites write and load: parity (flat config.json, upstream "
                "tensor names) or release (the released model's nested config.json and prefixed names, "
                "docs/checkpoints.md; the AR family) (default: parity)"
            ),
        ),
    ),
    RunOption(
        "seed",
        dict(
            type=int,
            default=0,
            help="offset added to every case seed and checkpoint seed (default: 0): the same suites on other random models",
        ),
    ),
    RunOption(
        "suite",
        dict(
            action="append",
            default=[],
            metavar="NAME",
            help="run only tests of this report suite (repeatable), e.g. --suite numerics",
        ),
    ),
    RunOption(
        "mutants",
        dict(
            action="store_true",
            default=False,
            help=(
                "after the suites, plant the target-level mutant catalogue in the target (through its checkpoint, "
                "config, capture registry and calls) and print its mutation score (docs/mutants.md)"
            ),
        ),
    ),
    RunOption(
        "quick",
        dict(
            action="store_true",
            default=False,
            help=(
                "the quick lane: every suite's property on the smallest cases that show it (cases/quick.toml), in eager "
                "and the graph stand-in, compile-time checks traced without code generation; its rows say size "
                "<size>-quick and a review compares them only with a quick baseline (docs/cli.md §11)"
            ),
        ),
    ),
    RunOption(
        "cases",
        dict(
            action="append",
            default=[],
            metavar="DIR",
            help=(
                "a directory of extra case files (<family>.toml) whose cases are added to the built-in ones "
                "(repeatable; a case name that already exists is an error)"
            ),
        ),
    ),
)


def add_run_options(add: Callable[..., Any], prefix: str) -> None:
    """Declare every run option through `add` (pytest `group.addoption` or argparse `add_argument`)."""
    for option in RUN_OPTIONS:
        add(option.flag(prefix), dest=option.dest(prefix), **option.kwargs)


def add_pytest_options(parser: Any) -> None:
    """The plugin's options: `--parity-<name>` in the `parity` group, plus the hidden summary switch.

    Also the session's first act: a case file that cannot be read no longer stops the collection
    (`parity.cases.defer_errors`); the suites' conftest imports the AR and DiT tables right after
    the options are declared, before any other hook of the plugin runs."""
    defer_errors(True)
    group = parser.getgroup("parity", "parity harness")
    add_run_options(group.addoption, PYTEST_PREFIX)
    group.addoption("--parity-no-summary", action="store_true", help=argparse.SUPPRESS)  # parity run prints its own
    parser.addini(
        "parity_scope",
        "which tests the plugin acts on: 'suites' (tests marked parity_suite(...); the default) or "
        "'all' (every test of the session: lane marks, the CPU thread count, a fresh Dynamo cache); "
        "set either way, it makes every session of the project a parity one",
        default=None,  # unset: a session is a parity one only by its options (parity.plugin.lanes)
    )
    parser.addini(
        "parity_short_lane_markers",
        "also give every test of a parity lane the short marker (cpu, gpu, slow), for a repository whose "
        "own lanes are called so (`pytest -m cpu`); the plugin then registers those three",
        type="bool",
        default=False,
    )


def pytest_args(values: Mapping[str, Any]) -> list[str]:
    """The plugin's command-line spelling of `parity run`'s parsed option values (unprefixed dests)."""
    argv: list[str] = []
    for option in RUN_OPTIONS:
        value = values.get(option.dest(""))
        flag = option.flag(PYTEST_PREFIX)
        if option.kwargs.get("action") == "append":
            for item in value or ():
                argv += [flag, str(item)]
        elif option.kwargs.get("action") == "store_true":
            argv += [flag] if value else []
        elif value is not None and value != option.kwargs.get("default"):
            argv += [flag, str(value)]
    return argv


def plugin_is_installed() -> bool:
    """Whether pytest loads the plugin by itself (the `pytest11` entry point of an installed parity)."""
    from importlib.metadata import entry_points

    return any((ep.name, ep.value) == ENTRY_POINT for ep in entry_points(group="pytest11"))


def plugin_load_args() -> list[str]:
    """`-p parity.plugin` for a pytest that would not find the plugin by itself (a checkout run
    without installing, e.g. `PYTHONPATH=.` on a GPU box); nothing where the entry point exists."""
    return [] if plugin_is_installed() else ["-p", ENTRY_POINT[1]]

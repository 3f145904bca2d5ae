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

PYTEST_PREFIX = "parity-"
ENTRY_POINT = ("parity", "parity.plugin")  # the pytest11 entry point: name, module
DEVICES = ("cpu", "cuda")
SIZES = ("tiny", "full")
DTYPES = ("fp32", "bf16", "fp16")
DEFAULT_DTYPE = {"cpu": "fp32", "cuda": "bf16"}


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
        "report-dir",
        dict(default=None, metavar="DIR", help="directory that receives one run directory per run (default: ./reports/runs)"),
    ),
    RunOption("run-id", dict(default=None, help="name of this run's directory (default: UTC timestamp + random suffix)")),
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
    """The plugin's options: `--parity-<name>` in the `parity` group, plus the hidden summary switch."""
    group = parser.getgroup("parity", "parity harness")
    add_run_options(group.addoption, PYTEST_PREFIX)
    group.addoption("--parity-no-summary", action="store_true", help=argparse.SUPPRESS)  # parity run prints its own
    parser.addini(
        "parity_scope",
        "which tests the plugin acts on: 'suites' (tests marked suite(...); the default) or 'all' "
        "(every test of the session: lane marks, the CPU thread count, a fresh Dynamo cache)",
        default="suites",
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

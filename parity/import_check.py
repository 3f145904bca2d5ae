"""Importing this module refuses a shadowed `parity`: one line naming both directories and the fix.

A directory named `parity` on the import path (a clone of this repository beside an engine, with
its parent on PYTHONPATH or as the working directory) is taken by Python as the `parity` package
(a namespace package: it has no `__init__.py`) ahead of an editable install, whose finder comes
after the path's. The harness's modules are then found in the installed tree, but `parity.cases`
resolves to the clone's `cases/` directory of case files, and the first import of it fails with
`cannot import name 'CaseFileError' from 'parity.cases' (unknown location)` and no hint.

The entry points import this module before any other part of the harness: the `parity` command
(`parity.cli`, `python -m parity`) and the pytest plugin (`parity.plugin`). The package's own
`parity/__init__.py` cannot say it: a shadowed `parity` is never this package, so it never runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

INSTALLED = Path(__file__).resolve().parent  # the package this module belongs to


class ShadowedParity(ImportError):
    """`import parity` found a directory that is not the installed package."""


def shadowing_problem() -> str | None:
    """One line saying what `import parity` found instead of the installed package at `INSTALLED`,
    and how to fix it; None when it found the installed package."""
    package = sys.modules.get("parity")
    found = list(dict.fromkeys(str(p) for p in getattr(package, "__path__", [])))  # the cwd and PYTHONPATH may both hold it
    if package is None or INSTALLED in {Path(p).resolve() for p in found}:
        return None
    where = ", ".join(found) or str(getattr(package, "__file__", None) or "an unknown location")
    parents = ", ".join(dict.fromkeys(str(Path(p).parent) for p in found)) or "its parent"
    return (
        f"parity: `import parity` found {where}, not the installed parity package at {INSTALLED}: "
        f"a directory named parity (a checkout?) shadows it; rename that directory, or drop {parents} "
        "from PYTHONPATH (or run from another directory)"
    )


def _is_the_command() -> bool:
    """Whether this process is the `parity` command (the console script or `python -m parity`)."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return argv0.name == "parity" or (argv0.name == "__main__.py" and argv0.parent.name == "parity")


def refuse_shadowed() -> None:
    """The `parity` command prints the line and exits 2; pytest (loading the plugin) prints it as its
    one `ERROR:` line (a `pytest.UsageError`, exit 4); anywhere else (a script importing the harness)
    it is the message of an ImportError (`ShadowedParity`)."""
    problem = shadowing_problem()
    if problem is None:
        return
    if _is_the_command():
        print(problem, file=sys.stderr)
        raise SystemExit(2)
    if "_pytest.config" in sys.modules:  # pytest loading the plugin: its one `ERROR:` line, exit 4
        import pytest

        raise pytest.UsageError(problem)
    raise ShadowedParity(problem)


refuse_shadowed()

"""Broken variants of the case-file machinery, for tests/harness/test_case_files_sessions.py: loaded as a
plugin of a child pytest session (`-p tests.support.case_variants`), chosen by `PARITY_CASE_VARIANT`, and
applied before the suites' conftest reads its first table.

- `eager`: a case file that cannot be read raises at import, as before deferral.
- `remember-only`: `add_case_dirs` remembers the directories and extends nothing already loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import parity.cases

VARIANT = os.environ.get("PARITY_CASE_VARIANT", "")

if VARIANT == "eager":
    parity.cases.deferring = lambda: False
elif VARIANT == "remember-only":

    def _remember(directories) -> None:
        parity.cases._extra_dirs = tuple(Path(d) for d in directories)

    parity.cases.add_case_dirs = _remember
    import parity.plugin.hooks

    parity.plugin.hooks.add_case_dirs = _remember

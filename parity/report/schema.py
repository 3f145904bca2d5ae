"""The shape of a run directory's files: their names, the columns of results.csv, a run's statuses
and the structured `data` payload of a row (docs/reports.md §4).

A leaf: it imports nothing of parity but `parity.compare`, so every other report module (the
writer, the reader, the baseline, the audit, the page) can share these names without a circle.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from parity.compare.metrics import BY_RULE, DIRECTIONS

RESULTS_FILE = "results.csv"
RUN_INFO_FILE = "run.json"
# `run.json`'s `status`: written `running` with the first row, then the end of the session:
# `complete` (every selected test ran), `interrupted` (a signal, with its name, or pytest stopped
# early) or `crashed` (an internal error). A run that died without recording its end (SIGKILL, a
# lost machine) still says `running`, with a process id that no longer exists. `incomplete`: every
# selected test ran but some rows could not be written (a full disk; `unwritten_rows` says how many).
RUNNING, COMPLETE, INTERRUPTED, CRASHED, INCOMPLETE = "running", "complete", "interrupted", "crashed", "incomplete"
RUN_STATUSES = (RUNNING, COMPLETE, INTERRUPTED, CRASHED, INCOMPLETE)

# The columns of docs/reports.md §4: the run's context, `site` (where inside the model a number was
# taken: `layer.3`, `logits`, `block.layers.1`, `step.12`; empty for whole-output checks), the
# number and its bound, `kind` (gate = the row decided a verdict, info = a number recorded beside
# it), `better` (lower / higher / equal: the direction a baseline comparison reads the value in),
# `bound` (fixed = a policy, measured = derived from noise measured in the same run, '' = no
# bound), `test` (pytest node id), `worker` (xdist worker or "main"), `time` (UTC); `tp` is the
# run's tensor-parallel size (1: one process); `family` is the suites' family directory the row's
# test lives in (`ar`, `dit`, `routing`, `selfcheck`, `sensitivity`, ...: `family_of_test`), kept
# in baselines (unlike the node id, which depends on where pytest ran) so a review knows which rows
# a target that leaves a family out cannot have; `data` is a JSON object a reader needs as numbers
# (a decode's token ids, the per-step errors, a stage chain's repro: `DATA_KEYS`), never parsed
# back out of `detail`.
COLUMNS = (
    "run_id",
    "suite",
    "case",
    "target",
    "mode",
    "site",
    "device",
    "dtype",
    "size",
    "tp",
    "metric",
    "value",
    "threshold",
    "verdict",
    "detail",
    "seed",
    "torch_version",
    "git_sha",
    "kind",
    "better",
    "bound",
    "family",
    "test",
    "worker",
    "time",
    "data",
)
KINDS = ("gate", "info")
BETTER = (*DIRECTIONS, BY_RULE)
# Columns filled from the run's context rather than by each check.
CONTEXT_COLUMNS = ("run_id", "target", "device", "dtype", "size", "tp", "torch_version", "git_sha", "worker")
# Columns that change on every run without saying anything about the numbers.
VOLATILE_COLUMNS = ("run_id", "time", "worker", "test", "git_sha")
# A baseline keeps the numbers, not the payloads the page draws from (`data`).
BASELINE_COLUMNS = tuple(c for c in COLUMNS if c not in VOLATILE_COLUMNS and c != "data")
CASE_KEYS = ["suite", "case", "target", "mode"]  # a case's verdict spans all its sites
ROW_KEYS = ["suite", "case", "target", "mode", "site", "metric"]  # a row between a baseline and a run
# The metric of the one row per (suite, family) a run leaves out because the target does not provide
# the family (or the suite does not apply to it): `case` is the family, `value` the tests not run.
NOT_PROVIDED = "family_not_provided"
# The report suites of the mutant catalogues (`parity.target.PLANTED_SUITE` for the planted one).
SENSITIVITY_SUITE = "sensitivity"
PLANTED_SUITE = "target_mutants"

# The keys a row's `data` may hold (docs/reports.md §4), and who writes them.
DATA_KEYS = {
    "tokens": "a `tokens` row: one list of token ids per batch row (decode)",
    "steps": "a `step_max_abs` row: the step logits' largest difference at every step (decode)",
    "rule": "a gate row judged by a stated tolerance rule: the rule's reason, also at the end of the detail in brackets",
    "status": "a stage row not judged: why (`not_observable`, `not_observed`, `not_comparable`: parity.localise.chain)",
    "repro": "a `first_diverging_stage` row: the repro's path inside the run directory ('' when none was written)",
    "summary": "a `first_diverging_stage` row: the chain's one-line summary",
    "what": "a `family_not_provided` row of a model family: the family's name (`Family.what`)",
    "missing": "a `family_not_provided` row of a model family: the target members it lacks",
}


class ReportError(ValueError):
    """A row that cannot be written as given (unknown column, bad verdict, bad kind), or a file that
    is not a parity results file."""


# `parity/suites/ar/test_numerics.py::...`, `suites/dit::image` (a family's not-provided row), an
# installed package's `site-packages/parity/suites/routing/...`: the directory after `suites/`.
_FAMILY_OF_TEST = re.compile(r"(?:^|/)suites/([A-Za-z0-9_]+)")


def family_of_test(test: str) -> str:
    """The suites' family directory a test node id lives in ('' for a test outside parity's suites)."""
    found = _FAMILY_OF_TEST.search(test)
    return found.group(1) if found else ""


def data_text(payload: Mapping[str, Any] | None) -> str:
    """A row's `data` cell: the payload as compact JSON with sorted keys ('' for none). Non-finite
    floats are written as JSON's `NaN` / `Infinity` extension, which `row_data` reads back."""
    if not payload:
        return ""
    unknown = sorted(set(payload) - set(DATA_KEYS))
    if unknown:
        raise ReportError(f"unknown data keys {unknown}; known: {', '.join(DATA_KEYS)} (docs/reports.md §4)")
    return json.dumps(dict(payload), sort_keys=True, separators=(",", ":"))


def row_data(cell: object) -> dict[str, Any]:
    """A row's `data` cell read back ({} when empty); ValueError for a cell that is not a JSON object."""
    if cell is None or cell == "" or (isinstance(cell, float) and cell != cell):
        return {}
    found = json.loads(str(cell))
    if not isinstance(found, dict):
        raise ValueError(f"expected a JSON object, found {type(found).__name__}")
    return found

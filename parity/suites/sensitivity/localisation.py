"""docs/localisation.md: which stage a localisation names for each mutant, from a run's rows.

The catalogue says which stage each numerics, decode, image and routing mutant must be localised
to (`Mutant.stage`), or why its defect sits in no one stage (`stage_note`); the sensitivity suite
holds every killed mutant to it (`localised_stage` gate rows, `test_sensitivity.py`). This table
is generated from a run's `localised_stage` rows, so it says what a run found, not what was hoped:
`python -m parity.suites.sensitivity.localisation RUN_DIR > docs/localisation.md`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from parity.compare import FAIL, NOT_APPLICABLE, PASS
from parity.suites.sensitivity.catalogue import FAMILY_TITLES, Mutant, all_mutants, applies_at

LOCALISED_SUITES = ("numerics", "decode", "image", "routing")
METRIC = "localised_stage"
TARGET_SHARE = 0.9  # the bar: at least 90% of single-stage mutants named exactly

HEADER = """# Where it diverges: the stage named for each mutant

Generated from a CPU-lane run's `localised_stage` rows (the sensitivity suite): do not edit by hand,
regenerate with `python -m parity.suites.sensitivity.localisation RUN_DIR > docs/localisation.md`.
How a stage is localised: [localise.md](localise.md).
"""


def in_scope(catalogue: Mapping[str, Mutant] | None = None) -> list[Mutant]:
    """The mutants of the suites that localise a failing case, by family (in each, as registered).
    The table is a single-process run's: the sharding mutants run only at `--tp 2`, where a stage
    map declares only the stages every rank holds whole (docs/targets.md §11), and are left out."""
    catalogue = all_mutants() if catalogue is None else catalogue
    order = list(FAMILY_TITLES.values())  # by family as docs/mutants.md lists them, not by import order
    mutants = [m for m in catalogue.values() if m.suite in LOCALISED_SUITES and applies_at(m, "cpu", 1)]
    return sorted(mutants, key=lambda m: order.index(m.group) if m.group in order else len(order))


def _verdicts(rows: pd.DataFrame) -> dict[str, str]:
    mine = rows[(rows["suite"] == "sensitivity") & (rows["metric"] == METRIC)]
    return {str(r.case): str(r.verdict) for r in mine.itertuples()}


def markdown(rows: pd.DataFrame, catalogue: Mapping[str, Mutant] | None = None) -> str:
    """The table: each in-scope mutant, the stage its defect sits in and whether the run named it."""
    verdicts = _verdicts(rows)
    mutants = in_scope(catalogue)
    single = [m for m in mutants if m.stage]
    exact = [m for m in single if verdicts.get(m.name) == PASS]
    missed = [m for m in single if m.stage_note]
    share = share_named(rows, catalogue)
    lines = [HEADER]
    lines.append(
        f"{len(mutants)} mutants in the localising suites. {len(single)} have their defect in one stage: "
        f"{len(exact)} named exactly ({share:.0%}; the bar is {TARGET_SHARE:.0%}), {len(missed)} known "
        f"{'miss' if len(missed) == 1 else 'misses'} listed with why. {len(mutants) - len(single)} sit in no one stage.\n"
    )
    lines.append("| mutant | suite | the stage its defect sits in | named in the run |")
    lines.append("|---|---|---|---|")
    for m in mutants:
        verdict = verdicts.get(m.name, "not run")
        note = m.stage_note.replace("|", "/")
        if m.stage and not m.stage_note:
            lines.append(f"| `{m.name}` | `{m.suite}` | `{m.stage}` | {({PASS: 'yes', FAIL: '**no**'}).get(verdict, verdict)} |")
        elif m.stage:
            lines.append(
                f"| `{m.name}` | `{m.suite}` | `{m.stage}` | no ({'n/a' if verdict == NOT_APPLICABLE else verdict}): {note} |"
            )
        else:
            lines.append(f"| `{m.name}` | `{m.suite}` | none: {note} | {'n/a' if verdict == NOT_APPLICABLE else verdict} |")
    return "\n".join(lines) + "\n"


def share_named(rows: pd.DataFrame, catalogue: Mapping[str, Mutant] | None = None) -> float:
    """The fraction of single-stage mutants (those with a catalogue stage) the run named exactly."""
    verdicts = _verdicts(rows)
    single = [m for m in in_scope(catalogue) if m.stage]
    return sum(1 for m in single if verdicts.get(m.name) == PASS) / len(single) if single else 0.0


if __name__ == "__main__":
    import argparse
    import sys

    from parity.report import RESULTS_FILE

    parser = argparse.ArgumentParser(prog="python -m parity.suites.sensitivity.localisation", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory with the sensitivity suite's rows")
    arguments = parser.parse_args()
    frame = pd.read_csv(arguments.run_dir / RESULTS_FILE, dtype=str, keep_default_na=False)
    from parity.suites.sensitivity import localisation  # the imported module, where the families registered

    sys.stdout.write(localisation.markdown(frame))

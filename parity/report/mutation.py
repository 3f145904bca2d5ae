"""The mutation score: how many of the mutant catalogue's mutants the suites killed on this lane.

Two catalogues write `killed` rows (case = the mutant, mode = the suite that must kill it): the
built-in one (`sensitivity`, planted in the built-in target) and, with `--mutants`, the one planted
in the run's target (`target_mutants`, docs/mutants.md "Your target's score"). `parity run` prints
both scores; the page heads each table with its own.
"""

from __future__ import annotations

import dataclasses
import sys

import pandas as pd

from parity.compare import NOT_APPLICABLE, PASS
from parity.report.schema import PLANTED_SUITE, SENSITIVITY_SUITE
from parity.report.summary import run_tp


@dataclasses.dataclass(frozen=True)
class MutationScore:
    """The sensitivity suite's verdict on the catalogue, on the lane the run used.

    `applicable` counts mutants that can show on this lane; a mutant that cannot (an equivalent
    mutant at this configuration) is `not_applicable` and counts neither as killed nor as a survivor.
    """

    killed: int
    applicable: int
    not_applicable: list[str]
    survivors: list[str]
    per_suite: dict[str, tuple[int, int]]  # suite -> (killed, applicable)
    device: str = "cpu"  # the run's device and tensor-parallel size: which of the catalogue's mutants it runs
    tp: int = 1
    # The planted catalogue's score (`PLANTED_SUITE` rows) names the target it was planted in.
    on: str = ""

    def line(self, catalogue: int | None = None) -> str:
        """The score in one line; with the catalogue's size (`catalogue`, else the catalogue this
        process has loaded), also how many mutants have no row: an interrupted or narrowed run
        scores only the mutants that ran, and must say so."""
        suites = ", ".join(f"{suite} {k}/{n}" for suite, (k, n) in sorted(self.per_suite.items()))
        if self.on:
            text = (
                f"mutation score on {self.on}: {self.killed}/{self.applicable} applicable target-level mutants killed ({suites})"
            )
        else:
            text = f"mutation score: {self.killed}/{self.applicable} applicable mutants killed on this lane ({suites})"
        if self.not_applicable:
            text += f"; not applicable here: {', '.join(self.not_applicable)}"
        if self.survivors:
            text += f"; SURVIVED: {', '.join(self.survivors)}"
        size = catalogue if catalogue is not None else _loaded_catalogue_size(self.device, self.tp, planted=bool(self.on))
        ran = self.applicable + len(self.not_applicable)
        if size is not None and ran < size:
            text += f"; {size - ran} of the catalogue's {size} mutants DID NOT RUN (an interrupted or narrowed run: the score covers {ran})"
        return text


def _loaded_planted_size() -> int | None:
    """The planted catalogue's size when this process has loaded it (every entry gets a row in any
    run that runs it: killed, survived or not applicable); looked up, never imported."""
    module = sys.modules.get("parity.suites.sensitivity.plant")
    return len(module.PLANTED) if module is not None and getattr(module, "PLANTED", None) else None


def _loaded_catalogue_size(device: str, tp: int, *, planted: bool = False) -> int | None:
    """How many of the mutant catalogue's mutants a run on `device` at tensor-parallel size `tp`
    runs (a sharding mutant runs only at its own size, every other one only in one process), when
    this process has loaded the catalogue (`parity run` has: its pytest collected the sensitivity
    suite), else None. Looked up, never imported: the report layer does not import the suites
    (tests/repo/test_layering.py)."""
    if planted:
        return _loaded_planted_size()
    catalogue = sys.modules.get("parity.suites.sensitivity.catalogue")
    if catalogue is None:
        return None
    try:
        lane = catalogue.lane_of(device)
        return sum(1 for mutant in catalogue.all_mutants().values() if catalogue.applies_at(mutant, lane, tp))
    except Exception:  # a catalogue that cannot load here says nothing about the run's rows
        return None


def mutation_score(frame: pd.DataFrame, *, planted_on: str | None = None) -> MutationScore | None:
    """The score from the sensitivity suite's `killed` rows (case = mutant, mode = the suite that
    must kill it), or None when the run has none. With `planted_on` (the target's name), the score
    of the planted catalogue's rows (`PLANTED_SUITE`) instead: mutants planted in that target."""
    suite = PLANTED_SUITE if planted_on is not None else SENSITIVITY_SUITE
    rows = frame[(frame["suite"] == suite) & (frame["metric"] == "killed")]
    if rows.empty:
        return None
    na = rows["verdict"] == NOT_APPLICABLE
    applicable = rows[~na]
    killed = applicable["verdict"] == PASS
    per_suite = {
        suite: (int((group["verdict"] == PASS).sum()), len(group)) for suite, group in applicable.groupby("mode", sort=True)
    }
    return MutationScore(
        killed=int(killed.sum()),
        applicable=len(applicable),
        not_applicable=rows.loc[na, "case"].tolist(),
        survivors=applicable.loc[~killed, "case"].tolist(),
        per_suite=per_suite,
        device=str(rows["device"].iloc[0]) if "device" in rows.columns else "cpu",
        tp=run_tp(rows),
        on=_planted_on(rows, planted_on),
    )


def _planted_on(rows: pd.DataFrame, name: str | None) -> str:
    """What a planted score names: the target's declared name, else its `--target` value."""
    if name is None:
        return ""
    return name or (str(rows["target"].iloc[0]) if "target" in rows.columns else "the target")

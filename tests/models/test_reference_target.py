"""`--target reference` is a valid run of every suite: it passes (trivially: the truth against
itself), graph modes skip with the reference's reason, and every suite still writes rows."""

from __future__ import annotations

import pytest

from tests.support.shared_run import SharedRun

pytestmark = pytest.mark.parity_slow

SUITES_WITH_ROWS = {
    "selfcheck",
    "expert_selection",
    "fail_closed_capture",
    "embedding_clamp",
    "numerics",
    "decode",
    "weight_coverage",
    "image",
    "sampler",
    "routing",
}


def test_every_suite_runs_and_passes_against_the_reference(reference_run: SharedRun) -> None:
    """The reference's quick run of every suite but sensitivity (`parity run --target reference
    --quick`), made once per session (tests/support/shared_run.py)."""
    assert reference_run.returncode == 0, reference_run.stdout[-4000:]
    frame = reference_run.rows
    gates = frame[frame["kind"] == "gate"]
    assert not gates["verdict"].isin(["fail", "error"]).any()
    assert set(frame["suite"]) >= SUITES_WITH_ROWS, sorted(set(frame["suite"]))
    assert (frame["target"] == "reference").all()
    skipped = frame[frame["verdict"] == "skip"]
    assert skipped["detail"].str.contains("supports_capture=False").any()  # graph modes skip with the reference's reason

"""Every plugin option works under pytest-xdist, in both spellings, with the report directory
outside the checkout, from the repository root without test paths and from another directory
with one. Before the plugin was an entry point, a worker's early argument parse did not know
`--report-dir`, read its value as a test path, chose another rootdir and never loaded the plugin:
every worker crashed and no test ran."""

from __future__ import annotations

from pathlib import Path

import pytest

from parity.report import read_results, read_run_info
from tests.support.helpers import PROJECT_ROOT, run_pytest

# The GPU lane's command (--parity-device cuda --parity-size full) takes the same options; here
# they carry CPU values so the test runs on any machine.
OPTIONS = {
    "--parity-device": "cpu",
    "--parity-size": "tiny",
    "--parity-dtype": "fp32",
    "--parity-target": "serving",
    "--parity-seed": "1",
    "--parity-suite": "selfcheck",
    "--parity-run-id": "xdist-run",
}


def _spelled(options: dict[str, str], equals: bool) -> list[str]:
    args: list[str] = []
    for flag, value in options.items():
        args += [f"{flag}={value}"] if equals else [flag, value]
    return args


@pytest.mark.parametrize(
    "equals, where",
    [(False, "root-without-paths"), (True, "elsewhere-with-path")],
    ids=["space-separated-from-the-root", "equals-from-another-directory"],
)
@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_options_reach_every_worker(equals: bool, where: str, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere"  # outside the checkout
    options = {**OPTIONS, "--parity-report-dir": str(out)}
    if where == "root-without-paths":
        # no test paths: the configuration's testpaths choose them (this repository's own leave the
        # suites out since the test command reads the shared CPU-lane run; -o puts them back)
        args = ["-o", "testpaths=parity/suites", "-m", "cpu", "-n", "2", *_spelled(options, equals), "-k", "selfcheck"]
        cwd = PROJECT_ROOT
    else:
        other = tmp_path / "other"
        other.mkdir()
        args, cwd = [str(PROJECT_ROOT / "parity" / "suites" / "selfcheck"), "-n", "2", *_spelled(options, equals)], other
    result = run_pytest(args, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = read_results(out / "xdist-run")
    assert len(rows) >= 10 and set(rows["suite"]) == {"selfcheck"}
    assert rows["worker"].str.startswith("gw").all(), "the rows must come from xdist workers"
    assert set(rows["device"]) == {"cpu"} and set(rows["target"]) == {"serving"} and set(rows["size"]) == {"tiny"}
    assert read_run_info(out / "xdist-run")["seed"] == 1

"""A failing suite test's traceback shows the suite's code (the test function, the check that
recorded the failing row) and the target's frame when the target raised; never the plugin's own
hook frames (`parity/plugin/__init__.py`)."""

from __future__ import annotations

import textwrap

import pytest

from tests.support.helpers import run_pytest_in_pytester

SUITE = textwrap.dedent(
    """
    import pytest

    pytestmark = pytest.mark.parity_suite("demo")

    def engine_forward(x):
        raise ValueError("the engine blew up at layer 3")

    def check_close(report, value):
        report.record(case="c", metric="rmse_vs_golden", value=value, threshold=0.1, verdict="fail" if value > 0.1 else "pass")

    def test_recorded_row_fails(parity_report):
        report = parity_report
        check_close(report, 0.01)
        check_close(report, 0.5)  # the failing check
        check_close(report, 0.02)

    def test_target_raises_in_a_guard(parity_report):
        report = parity_report
        with report.guard(case="g"):
            engine_forward(2)  # the target's call
        report.record(case="after", metric="m", value=0.0)

    def test_bare_assert(parity_report):
        report = parity_report
        report.record(case="a", metric="m", value=0.0)
        assert 1 == 2, "the suite's own assertion"

    RULE = "the target may be at most 2x as far from the fp64 golden as the reference in the same dtype is " * 4

    def test_rows_with_a_rule(parity_report):
        for site in ("layer.2", "layer.3", "logits"):
            parity_report.record(
                case="mixed", site=site, metric="rmse_vs_golden", value=0.0025038008, threshold=2.5052859e-08,
                verdict="fail", detail=f"above noise floor; {site}: ratio=3.1e+05 [{RULE.strip()}]",
                data={"rule": RULE.strip()},  # as a rule's verdict writes it (docs/reports.md §4)
            )
    """
)

PLUGIN_FILE = "parity/plugin/__init__.py"


@pytest.fixture
def failed_output(pytester: pytest.Pytester) -> str:
    pytester.makepyfile(test_suite_demo=SUITE)
    result = run_pytest_in_pytester(pytester, ["--parity-report-dir", str(pytester.path / "out")])
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.assert_outcomes(failed=4)
    return result.stdout.str()


def _section(output: str, test: str) -> str:
    """The FAILURES section of one test."""
    start = output.index(f" {test} ")
    rest = output[start:].split("\n_____", 1)[0]
    return rest.split("= short test summary", 1)[0].split("= parity report", 1)[0]


def test_a_recorded_failing_row_points_at_the_check_that_recorded_it(failed_output: str) -> None:
    section = _section(failed_output, "test_recorded_row_fails")
    assert ">       check_close(report, 0.5)  # the failing check" in section, section
    assert '>       report.record(case="c", metric="rmse_vs_golden"' in section, section
    assert "E       AssertionError: 1 failing report row(s):" in section, section
    assert "test_suite_demo.py:" in section
    assert PLUGIN_FILE not in section and "raise AssertionError(rep.failure_text())" not in section, section


def test_a_target_that_raised_inside_a_guard_shows_its_frame(failed_output: str) -> None:
    section = _section(failed_output, "test_target_raises_in_a_guard")
    assert '>       raise ValueError("the engine blew up at layer 3")' in section, section
    assert "engine_forward(2)  # the target's call" in section, section
    assert "The above exception was the direct cause of the following exception" in section, section
    assert PLUGIN_FILE not in section, section


def test_a_rule_paragraph_is_said_once_and_each_row_in_one_short_line(failed_output: str) -> None:
    section = _section(failed_output, "test_rows_with_a_rule")
    rule = "the target may be at most 2x as far from the fp64 golden as the reference in the same dtype is"
    assert section.count(rule) == 4, section  # once (the paragraph repeats its sentence four times), not per row
    rows = [text for line in section.splitlines() if (text := line.removeprefix("E").strip()).startswith("demo/mixed/")]
    assert len(rows) == 3 and all(len(line) <= 200 for line in rows), rows
    assert rows[0] == (
        "demo/mixed/eager @layer.2: rmse_vs_golden=0.002504 (bound 2.505e-08, rule 1) fail: above noise floor; layer.2: ratio=3.1e+05"
    )


def test_an_error_row_in_the_failure_names_the_targets_line(failed_output: str) -> None:
    section = _section(failed_output, "test_target_raises_in_a_guard")
    assert (
        "demo/g/eager: exception: ValueError (at test_suite_demo.py:6 in engine_forward): the engine blew up at layer 3"
        in section
    )


def test_no_failure_shows_the_plugin_frames(failed_output: str) -> None:
    assert '>       assert 1 == 2, "the suite\'s own assertion"' in _section(failed_output, "test_bare_assert")
    assert PLUGIN_FILE not in failed_output, failed_output

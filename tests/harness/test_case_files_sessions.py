"""Case files in a pytest session of the suites, each in a fresh process: the suites'
tables are loaded once per process, by the suites' conftest before pytest configures the session.

- A case file that cannot be read blocks only the sessions that select a test reading it: a broken
  `ar.toml`, `dit.toml` and `routing.toml` leave `--suite selfcheck` running (it used to end in a
  conftest traceback); selecting a reader of the broken file is one `ERROR:` line and exit 4.
- `--parity-cases DIR/ar.toml` adds its cases to the AR tables, which the conftest loaded before
  the directory was known (they used to be silently ignored).

Each property is shown failing under the broken variant it guards against (`tests/support/case_variants.py`,
loaded as a plugin of the child session).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.helpers import PROJECT_ROOT, run_parity, run_pytest

VARIANTS = "tests.support.case_variants"


def _broken_cases(tmp_path: Path) -> Path:
    """The built-in cases with ar.toml, dit.toml and routing.toml each broken in its own way."""
    cases = tmp_path / "cases"
    shutil.copytree(PROJECT_ROOT / "cases", cases)
    (cases / "ar.toml").write_text((cases / "ar.toml").read_text() + "\n[[prompts]]\nname = 'bad'\nrows = 3\n")
    (cases / "dit.toml").write_text("[[velocity]\n")  # not TOML
    routing = (cases / "routing.toml").read_text().replace("logit_std = 2.0", "logit_std = nan", 1)
    (cases / "routing.toml").write_text(routing)
    return cases


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_broken_case_files_of_other_families_do_not_stop_a_selfcheck_run(tmp_path: Path) -> None:
    cases = _broken_cases(tmp_path)
    result = run_parity(["run", "--suite", "selfcheck", "--report-dir", str(tmp_path / "out")], PARITY_CASES_DIR=str(cases))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output and "ImportError while loading conftest" not in output
    assert "parity summary" in result.stdout and "selfcheck" in result.stdout


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_selecting_a_reader_of_a_broken_case_file_is_one_line_and_exit_4(tmp_path: Path) -> None:
    cases = _broken_cases(tmp_path)
    out = tmp_path / "out"
    result = run_pytest(
        ["parity/suites", "--parity-suite", "selfcheck", "--parity-suite", "numerics", "--parity-report-dir", str(out), "-q"],
        PARITY_CASES_DIR=str(cases),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 4, output
    errors = [line for line in output.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1 and "ar.toml: table [prompts] case 'bad': key 'rows'" in errors[0], output
    assert "Traceback" not in output and not out.exists()


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_without_deferral_a_broken_ar_toml_stops_every_session(tmp_path: Path) -> None:
    """The broken variant: case files read eagerly at import (`parity.cases.deferring` off)."""
    cases = _broken_cases(tmp_path)
    result = run_pytest(
        ["-p", VARIANTS, "parity/suites", "--parity-suite", "selfcheck", "--parity-report-dir", str(tmp_path / "out"), "-q"],
        PARITY_CASES_DIR=str(cases),
        PARITY_CASE_VARIANT="eager",
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "ar.toml" in output, output


def _extra_prompt(tmp_path: Path) -> Path:
    extra = tmp_path / "mine"
    extra.mkdir()
    (extra / "ar.toml").write_text('[[prompts]]\nname = "my-own-prompt"\nrows = [[3, 17, 42, 99]]\n')
    return extra


def _collected(tmp_path: Path, *args: str, **env: str) -> str:
    result = run_pytest(
        [*args, "parity/suites/ar/test_numerics.py", "--collect-only", "-q", "--parity-cases", str(_extra_prompt(tmp_path))],
        **env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_an_extra_ar_toml_adds_its_prompt_to_tables_loaded_before_the_session_was_configured(tmp_path: Path) -> None:
    assert "my-own-prompt" in _collected(tmp_path)


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_without_extending_loaded_tables_the_extra_prompt_is_silently_ignored(tmp_path: Path) -> None:
    """The broken variant: `add_case_dirs` only remembers the directories (files read afterwards get them)."""
    assert "my-own-prompt" not in _collected(tmp_path, "-p", VARIANTS, PARITY_CASE_VARIANT="remember-only")

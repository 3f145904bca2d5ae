"""The plugin is a good neighbour in a project that has its own tests, fixtures and markers.

Installed, the plugin loads in every pytest session of the environment. A session that runs no
parity test must not import torch or pandas through it, and nothing parity adds may take a name a
project commonly uses (`device`, `target`, `report` fixtures; `cpu` / `gpu` markers). Each check
has its broken variant beside it: the import probe sees torch once the session is a parity one,
and the fixture probe sees parity's fixture when the short names are made global.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.support.helpers import plugin_args, run_pytest_in_pytester, subprocess_env

IMPORT_PROBE = textwrap.dedent(
    """
    import sys

    def test_nothing_heavy_was_imported():
        assert "parity.plugin" in sys.modules  # the plugin was loaded: the probe is not vacuous
        heavy = sorted(name for name in ("torch", "pandas", "parity.plugin.hooks") if name in sys.modules)
        print("HEAVY", heavy)
        assert not heavy, heavy
    """
)


def _subprocess_pytest(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """A fresh interpreter: what a project's own `pytest` imports, nothing this process has."""
    for name, value in subprocess_env().items():
        pytester._monkeypatch.setenv(name, value)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *plugin_args(), "-s", *args)


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_a_session_without_parity_tests_imports_neither_torch_nor_pandas(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_project=IMPORT_PROBE)
    result = _subprocess_pytest(pytester)
    assert result.ret == 0, result.stdout.str()
    assert "HEAVY []" in result.stdout.str(), result.stdout.str()


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_the_import_probe_sees_a_parity_session_import_torch(pytester: pytest.Pytester) -> None:
    """The broken variant of the check above: a parity session (a `--parity-*` option) does import
    the harness, and the probe says so."""
    pytester.makepyfile(test_project=IMPORT_PROBE)
    result = _subprocess_pytest(pytester, "--parity-report-dir", str(pytester.path / "out"))
    assert result.ret == 1
    assert "HEAVY ['pandas', 'parity.plugin.hooks', 'torch']" in result.stdout.str(), result.stdout.str()


PROJECT_CONFTEST = textwrap.dedent(
    """
    import pytest

    @pytest.fixture
    def device():
        return "the project's device"

    @pytest.fixture
    def target():
        return "the project's target"

    @pytest.fixture
    def report():
        return "the project's report"
    """
)
PROJECT_INI = textwrap.dedent(
    """
    [pytest]
    addopts = --strict-markers
    markers =
        cpu: the project's own CPU lane
        gpu: the project's own GPU lane
    """
)
PROJECT_TESTS = textwrap.dedent(
    """
    import pytest

    @pytest.mark.cpu
    def test_project_cpu(device, target, report):
        assert (device, target, report) == ("the project's device", "the project's target", "the project's report")

    @pytest.mark.gpu
    def test_project_gpu(device):
        assert device == "the project's device"
    """
)
PARITY_TEST = textwrap.dedent(
    """
    import pytest

    pytestmark = pytest.mark.parity_suite("demo")

    def test_parity_side(parity_report, parity_device, parity_target):
        assert str(parity_device) == "cpu" and parity_target.name == "serving"
        parity_report.record(case="side-by-side", metric="m", value=0.0, threshold=1.0)
    """
)
OUTSIDE_THE_CONFTEST = textwrap.dedent(
    """
    import pytest

    def test_device_is_not_parity_s(request):
        with pytest.raises(pytest.FixtureLookupError):
            request.getfixturevalue("device")
    """
)


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """An engine repository: its own `device`, `target` and `report` fixtures and `cpu`/`gpu`
    markers under --strict-markers, a parity test beside its tests, and a folder its conftest does
    not reach."""
    pytester.makeini(PROJECT_INI)
    pytester.mkpydir("engine_tests")
    (pytester.path / "engine_tests" / "conftest.py").write_text(PROJECT_CONFTEST)
    (pytester.path / "engine_tests" / "test_engine.py").write_text(PROJECT_TESTS)
    (pytester.path / "engine_tests" / "test_parity_demo.py").write_text(PARITY_TEST)
    pytester.mkpydir("other")
    (pytester.path / "other" / "test_other.py").write_text(OUTSIDE_THE_CONFTEST)
    return pytester


def _run(project: pytest.Pytester, *args: str) -> pytest.RunResult:
    return run_pytest_in_pytester(project, ["-q", "--parity-report-dir", str(project.path / "out"), *args])


def test_a_projects_own_fixtures_and_markers_run_beside_parity_s(project: pytest.Pytester) -> None:
    result = _run(project)
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=4)


@pytest.mark.parametrize(
    ("selection", "selected"),
    [("cpu", ["test_project_cpu"]), ("gpu", ["test_project_gpu"]), ("parity_cpu", ["test_parity_side"])],
)
def test_lanes_do_not_mix_with_the_projects_markers(project: pytest.Pytester, selection: str, selected: list[str]) -> None:
    """parity's lane marker goes on parity's tests only, and the project's `-m cpu` selects only its own."""
    result = _run(project, "-m", selection, "--co")
    collected = sorted(line.rsplit("::", 1)[-1] for line in result.stdout.lines if "::" in line)
    assert collected == selected, result.stdout.str()


def test_the_fixture_probe_sees_parity_s_fixtures_made_global(project: pytest.Pytester) -> None:
    """The broken variant: parity's short fixture names registered for the whole session (as the
    plugin once did) reach the folder the project's conftest does not, and the probe fails."""
    result = _run(project, "-p", "parity.plugin.short_names", "other")
    assert result.ret == 1, result.stdout.str()
    result.assert_outcomes(failed=1)


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_parity_s_own_suites_run_beside_the_project_without_an_option(project: pytest.Pytester) -> None:
    """`pytest --pyargs parity.suites` in the project, no `--parity-*` option: collecting the suites
    makes the session a parity one, the suites find their fixtures under their short names, and
    the project's tests keep theirs."""
    (project.path / "engine_tests" / "test_parity_demo.py").unlink()  # this one needs an option or the ini
    result = _subprocess_pytest(project, "-v", "--pyargs", "parity.suites", "engine_tests", "-k", "selfcheck or test_engine")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines_random(
        [
            "*selfcheck/test_selfcheck.py::*PASSED*",
            "*test_engine.py::test_project_cpu PASSED*",
            "*test_engine.py::test_project_gpu PASSED*",
        ]
    )
    assert len(list((project.path / "reports" / "runs").glob("*/results.csv"))) == 1

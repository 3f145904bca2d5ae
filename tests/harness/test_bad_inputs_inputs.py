"""Bad input that was accepted but meant nothing: case files, checkpoints, options.

Each row of `ROWS` makes one such mistake and names the words of the one line that must explain
it; `test_bad_input` checks every row as tests/harness/test_bad_inputs.py does (`check_bad_input`: one
explaining line, no traceback, a non-zero exit) and, beyond it, the exit status README documents
for that command (`EXIT`: 1 a raised error or a refused checkpoint, 2 a mistaken option of `parity
review` / `parity make-checkpoint`, 4 anything `parity run` or a pytest session refuses before any
test). `test_the_checks_are_what_catch_these` switches the check of a row off (the broken variant)
and shows the row's mistake pass silently.

Case files are read per value (a tolerance's range with its reason), per case (sizes that multiply
past `MAX_CASE_ELEMENTS`) and per directory (a misspelt file in `--parity-cases`); a session that
needs a broken file is refused with exit 4 (fresh processes: the suites' tables are loaded once per
process). Checkpoints: release configs hold the types and values the flat layout holds, a release
directory decodes with its VAE or its stand-in or is refused naming both, and `inspect-checkpoint`
flags NaN and float8 tensors.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import parity.cases
from parity.cases import Table, load_case_file
from parity.compare import Tolerance
from tests.support.bad_input_table import Bad, Outcome, check_bad_input, cli, process, raised
from tests.support.helpers import PROJECT_ROOT, run_parity, run_pytest_here

# ---------------------------------------------------------------------------------------------
# Case files
# ---------------------------------------------------------------------------------------------


def _schema(kind: str) -> dict[str, Table]:
    from parity.suites.dit.support import VelocityCase
    from parity.suites.routing.cases import GridSpec

    return {
        "tolerances": {"tolerances": Table(Tolerance, keyed=True)},
        "grid": {"grid": Table(GridSpec, many=False)},
        "velocity": {"velocity": Table(VelocityCase)},
    }[kind]


GOOD = {
    "tolerances": '[tolerances.t]\natol = 1e-5\nrtol = 1e-6\nreason = "r"\n',
    "grid": (
        '[grid]\nexperts = [8]\nk = [2]\nrows = [7]\ndtypes = ["fp32"]\nrenormalize = [true]\nkinds = ["softmax"]\n'
        "logit_std = 2.0\nseed = 1\ntie_flip_spacings = 2.0\n"
    ),
    "velocity": '[[velocity]]\nname = "v"\nsize = "tiny"\nheight = 32\nwidth = 32\ntext_lens = [4]\ntimestep = 0.5\nseed = 1\n',
}


def case_file(kind: str, old: str, new: str) -> Callable[[Path], Outcome]:
    """A row: the good table of `kind` with `old` replaced by `new`, loaded with its real record type."""

    def run(tmp_path: Path) -> Outcome:
        assert old in GOOD[kind], f"{old!r} not in the {kind} table"
        path = tmp_path / f"{kind}.toml"
        path.write_text(GOOD[kind].replace(old, new, 1))
        return raised(lambda: load_case_file(path, _schema(kind)))

    return run


def misspelt_in_cases_dir(tmp_path: Path) -> Outcome:
    """`--parity-cases DIR` holding `selfchek.toml`: named, never silently ignored."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "selfchek.toml").write_text('[[psnr]]\nname = "mine"\ndata_range = 255.0\noffset = 1.0\nsize = 8\n')
    from parity.suites.selfcheck import test_selfcheck as selfcheck

    schema = {
        "tolerances": Table(Tolerance, keyed=True),
        "psnr": Table(selfcheck.PsnrCase),
        "cosine": Table(selfcheck.CosineCase),
        "ulp": Table(selfcheck.UlpCase),
        "determinism": Table(selfcheck.DeterminismCase),
    }
    parity.cases.add_case_dirs([extra])
    try:
        return raised(lambda: load_case_file("selfcheck.toml", schema))
    finally:
        parity.cases.add_case_dirs([])


def _copy_cases(tmp_path: Path, name: str, old: str, new: str) -> Path:
    cases = tmp_path / "cases"
    shutil.copytree(PROJECT_ROOT / "cases", cases)
    text = (cases / name).read_text()
    assert old in text
    (cases / name).write_text(text.replace(old, new, 1))
    return cases


def parity_run_process(*args: str, cases: Callable[[Path], Path] | None = None) -> Callable[[Path], Outcome]:
    """`parity run --suite selfcheck ARGS` in a fresh process (the suites' tables load once per
    process), with a replaced case set when `cases` makes one; no run directory may be left."""

    def run(tmp_path: Path) -> Outcome:
        env = {"PARITY_CASES_DIR": str(cases(tmp_path))} if cases else {}
        command = ["run", "--report-dir", str(tmp_path / "reports"), "--suite", "selfcheck", *args]
        outcome = process(run_parity([a if a != "{tmp}" else str(tmp_path) for a in command], **env))
        left = list((tmp_path / "reports").iterdir()) if (tmp_path / "reports").is_dir() else []
        outcome.output += "".join(f"\nleft a run directory: {p}" for p in left if p.is_dir())
        return outcome

    return run


def misspelt_dir(tmp_path: Path) -> Path:
    extra = tmp_path / "mine"
    extra.mkdir()
    (extra / "selfchek.toml").write_text('[[psnr]]\nname = "mine"\ndata_range = 255.0\noffset = 1.0\nsize = 8\n')
    return extra


def run_with_misspelt_cases(tmp_path: Path) -> Outcome:
    return parity_run_process("--cases", str(misspelt_dir(tmp_path)))(tmp_path)


# ---------------------------------------------------------------------------------------------
# Checkpoints: one tiny release AR and one tiny release DiT directory per module, a copy edited per row
# ---------------------------------------------------------------------------------------------


@functools.cache
def _release_dirs(root: str) -> dict[str, Path]:
    from reference_models.checkpoints import make_checkpoint

    return {kind: make_checkpoint(kind, "tiny", 0, Path(root) / kind, layout="release") for kind in ("ar", "dit")}


@functools.cache
def _parity_ar(root: str) -> Path:
    from reference_models.checkpoints import make_checkpoint

    return make_checkpoint("ar", "tiny", 0, Path(root) / "parity-ar")


def _loader(name: str) -> Callable[[Path], Any]:
    from reference_models.ar.adapter import ReferenceARAdapter
    from reference_models.dit.adapter import ReferenceDiT
    from serving_models.target import make_target

    return {
        "serving-ar": lambda d: make_target().load_ar(d, "cpu", torch.float32),
        "reference-ar": lambda d: ReferenceARAdapter.load(d, "cpu", torch.float32),
        "serving-dit": lambda d: make_target().load_dit(d, "cpu", torch.float32),
        "reference-dit": lambda d: ReferenceDiT.load(d, "cpu", torch.float32),
    }[name]


def _edit_config(path: Path, *keys: str, value: Any) -> None:
    data = json.loads(path.read_text())
    section = data
    for key in keys[:-1]:
        section = section[key]
    section[keys[-1]] = value
    path.write_text(json.dumps(data))


def _copy(tmp_path: Path, kind: str) -> Path:
    source = _release_dirs(str(tmp_path.parent / "release-checkpoints"))[kind]
    directory = tmp_path / "ckpt"
    shutil.copytree(source, directory)
    return directory


def release_config(loader: str, *keys: str, value: Any) -> Callable[[Path], Outcome]:
    """The tiny release directory of the loader's family with one config key set to `value`, loaded."""

    def run(tmp_path: Path) -> Outcome:
        directory = _copy(tmp_path, loader.rsplit("-", 1)[1])
        _edit_config(directory / "config.json", *keys, value=value)
        return raised(lambda: _loader(loader)(directory))

    return run


def flat_ar_config(key: str, value: Any) -> Callable[[Path], Outcome]:
    def run(tmp_path: Path) -> Outcome:
        directory = tmp_path / "ckpt"
        shutil.copytree(_parity_ar(str(tmp_path.parent / "parity-checkpoints")), directory)
        _edit_config(directory / "config.json", key, value=value)
        return raised(lambda: _loader("serving-ar")(directory))

    return run


def _edit_tensors(directory: Path, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    path = directory / "model.safetensors"
    save_file(change(load_file(str(path))), str(path))


def inspect_with(change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Callable[[Path], Outcome]:
    """`parity inspect-checkpoint` of a parity-layout tiny AR with its tensors changed."""

    def run(tmp_path: Path) -> Outcome:
        directory = tmp_path / "ckpt"
        shutil.copytree(_parity_ar(str(tmp_path.parent / "parity-checkpoints")), directory)
        _edit_tensors(directory, change)
        return cli("inspect-checkpoint", directory)

    return run


def all_nan(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**tensors, "gen_head.weight": torch.full_like(tensors["gen_head.weight"], math.nan)}


def float8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**tensors, "gen_head.weight": tensors["gen_head.weight"].to(torch.float8_e4m3fn)}


def dit_without_decoder(tmp_path: Path) -> Outcome:
    directory = _copy(tmp_path, "dit")
    _edit_tensors(directory, lambda t: {n: v for n, v in t.items() if not n.startswith("vae_decoder.")})
    return raised(lambda: _loader("reference-dit")(directory))


def vae_without_diffusers(loader: str) -> Callable[[Path], Outcome]:
    """A release DiT directory that decodes with its VAE (`gen_vae.*`, no stand-in), in a process
    without diffusers: one line saying what to install."""

    def run(tmp_path: Path) -> Outcome:
        directory = _copy(tmp_path, "dit")
        _edit_tensors(
            directory,
            lambda t: {
                **{n: v for n, v in t.items() if not n.startswith("vae_decoder.")},
                "gen_vae.decoder.conv_in.weight": torch.zeros(8, 16, 3, 3),
            },
        )
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(sys.modules, "diffusers", None)  # `import diffusers` raises ImportError
            return raised(lambda: _loader(loader)(directory))

    return run


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


def parity_run(*args: str) -> Callable[[Path], Outcome]:
    """`parity run` in-process, for options refused before pytest starts."""
    return lambda tmp_path: cli("run", "--report-dir", tmp_path / "reports", "--suite", "selfcheck", *args)


def pytest_session(*args: str) -> Callable[[Path], Outcome]:
    """`pytest ARGS` as an in-process session of the suites (refused before any test)."""

    def run(tmp_path: Path) -> Outcome:
        paths = [str(PROJECT_ROOT / a) if a.startswith("parity/") else a for a in args]
        return Outcome(*run_pytest_here([*paths, "-q"], basetemp=tmp_path / "basetemp", refused=True))

    return run


# ---------------------------------------------------------------------------------------------
# The table: (id, what the user did, the words the one explaining line must hold), and the exit status
# ---------------------------------------------------------------------------------------------

TOO_LOOSE = "expected float <= 1 (a tolerance of 1 or more accepts any answer"
WHOLE_CASE = "expected a case of at most 4294967296 elements"
EPS = "llm_config.text_config.rms_norm_eps"
# fmt: off
ROWS = [
    # -- case files: per value, per case, per directory, per session -----------------------------
    Bad("tolerance-atol-1e308", case_file("tolerances", "atol = 1e-5", "atol = 1e308"), ("tolerances.toml", "[tolerances.t]", "'atol'", TOO_LOOSE, "found float 1e+308")),
    Bad("tolerance-rtol-1.5", case_file("tolerances", "rtol = 1e-6", "rtol = 1.5"), ("tolerances.toml", "'rtol'", TOO_LOOSE, "found float 1.5")),
    Bad("grid-sizes-multiply-past-limit", case_file("grid", "experts = [8]\nk = [2]\nrows = [7]", "experts = [1048576]\nk = [2]\nrows = [1048576]"), ("grid.toml", "[grid]", WHOLE_CASE, "experts[0] 1048576 x k[0] 2 x rows[0] 1048576")),
    Bad("velocity-sizes-multiply-past-limit", case_file("velocity", "height = 32\nwidth = 32\ntext_lens = [4]", f"height = 1024\nwidth = 1024\ntext_lens = [{', '.join(['4096'] * 64)}]"), ("velocity.toml", "[velocity] case 'v'", WHOLE_CASE, "height 1024 x width 1024 x text_lens x64")),
    Bad("case-file-misspelt-in-cases-dir", misspelt_in_cases_dir, ("selfchek.toml", "not a case file parity reads", "did you mean selfcheck.toml?")),
    Bad("case-file-broken-run-exit-4", parity_run_process(cases=lambda tmp: _copy_cases(tmp, "selfcheck.toml", "data_range = 255.0", 'data_range = "255"')), ("ERROR: ", "selfcheck.toml: table [psnr] case 'psnr-offset-uint8': key 'data_range': expected float, found str '255'"), marks=(pytest.mark.parity_slow,)),
    Bad("case-file-misspelt-run-exit-4", run_with_misspelt_cases, ("ERROR: --parity-cases", "selfchek.toml", "did you mean selfcheck.toml?"), marks=(pytest.mark.parity_slow,)),
    # -- checkpoints: release configs as strict as the flat layout, decoders, flagged tensors -------
    Bad("ar-release-eps-negative-reference", release_config("reference-ar", "llm_config", "text_config", "rms_norm_eps", value=-1), ("config.json", f"'{EPS}'", "expected a positive, finite float", "found int -1")),
    Bad("ar-release-eps-negative-serving", release_config("serving-ar", "llm_config", "text_config", "rms_norm_eps", value=-1), ("config.json", f"'{EPS}'", "expected a positive, finite float", "found int -1")),
    Bad("ar-release-eps-nan-serving", release_config("serving-ar", "llm_config", "text_config", "rms_norm_eps", value=math.nan), ("config.json", f"'{EPS}'", "expected a finite float", "found float nan")),
    Bad("ar-release-eps-zero-reference", release_config("reference-ar", "llm_config", "text_config", "rms_norm_eps", value=0.0), ("config.json", f"'{EPS}'", "expected a positive, finite float", "found float 0.0")),
    Bad("ar-release-heads-zero-reference", release_config("reference-ar", "llm_config", "text_config", "num_attention_heads", value=0), ("'llm_config.text_config.num_attention_heads'", "expected a positive int", "found int 0")),
    Bad("ar-release-hidden-str-serving", release_config("serving-ar", "llm_config", "text_config", "hidden_size", value="64"), ("'llm_config.text_config.hidden_size'", "expected int", "found str '64'")),
    Bad("ar-flat-eps-negative", flat_ar_config("rms_norm_eps", -1e-6), ("config.json", "'rms_norm_eps'", "expected a positive, finite float", "found float -1e-06")),
    Bad("dit-release-hidden-zero-reference", release_config("reference-dit", "gen_dit_config", "hidden_size", value=0), ("config.json", "hidden_size 0", "expected an int >= 1")),
    Bad("dit-release-hidden-zero-serving", release_config("serving-dit", "gen_dit_config", "hidden_size", value=0), ("config.json", "hidden_size 0", "expected an int >= 1")),
    Bad("dit-release-eps-str-serving", release_config("serving-dit", "gen_dit_config", "norm_eps", value="1e-5"), ("config.json", "'gen_dit_config.norm_eps'", "expected a finite float", "found str '1e-5'")),
    Bad("dit-release-eps-nan-reference", release_config("reference-dit", "gen_dit_config", "norm_eps", value=math.nan), ("config.json", "'gen_dit_config.norm_eps'", "expected a finite float", "found float nan")),
    Bad("dit-release-vae-scale-zero-reference", release_config("reference-dit", "gen_vae_config", "scaling_factor", value=0), ("scaling_factor 0", "expected a positive, finite float")),
    Bad("dit-release-no-decoder", dit_without_decoder, ("ckpt", "no decoder", "gen_vae.*", "vae_decoder.*")),
    Bad("dit-release-vae-without-diffusers-reference", vae_without_diffusers("reference-dit"), ("ckpt", "needs diffusers", "pip install 'parity[vae]'")),
    Bad("dit-release-vae-without-diffusers-serving", vae_without_diffusers("serving-dit"), ("ckpt", "needs diffusers", "pip install 'parity[vae]'")),
    Bad("inspect-all-nan-tensor", inspect_with(all_nan), ("tensor gen_head.weight", "all 4096 values are NaN")),
    Bad("inspect-float8-tensor", inspect_with(float8), ("tensor gen_head.weight: dtype torch.float8_e4m3fn", "quantised float8")),
    # -- options: valid one by one, meaningless together or as given --------------------------
    Bad("run-workers-negative", parity_run("-n", "-2"), ("parity run: argument -n/--numprocesses", "got '-2'")),
    Bad("run-overwrite-without-run-id", parity_run("--overwrite"), ("parity run: --overwrite needs --run-id",)),
    Bad("run-append-without-run-id", parity_run("--append"), ("parity run: --append needs --run-id",)),
    Bad("run-append-to-no-run", parity_run("--run-id", "nope", "--append"), ("--append --run-id 'nope'", "no run of that id", "nothing to add to")),
    Bad("run-report-dir-empty", lambda tmp_path: cli("run", "--report-dir", "", "--suite", "selfcheck"), ("argument --report-dir", "'' is an empty directory name")),
    Bad("run-pytest-args-set-run-id", parity_run("--", "--parity-run-id", "b"), ("pytest arguments after -- set parity's own options", "--parity-run-id (give --run-id to parity run)")),
    Bad("run-pytest-args-set-run-id-equals", parity_run("--", "-q", "--parity-run-id=b"), ("--parity-run-id (give --run-id to parity run)",)),
    Bad("review-force-without-write-baseline", lambda tmp_path: cli("review", tmp_path / "run", "--force"), ("parity review: --force applies only with --write-baseline",)),
    Bad("review-margin-inf", lambda tmp_path: cli("review", tmp_path / "run", "--margin", "inf"), ("argument --margin", "margin must be a non-negative fraction of the bound, got inf")),
    Bad("make-checkpoint-seed-negative", lambda tmp_path: cli("make-checkpoint", "ar", tmp_path / "ckpt", "--seed", "-1"), ("parity make-checkpoint: argument --seed", "-1: expected an integer in [0, 2147483647]")),
    Bad("make-checkpoint-shard-bytes-zero", lambda tmp_path: cli("make-checkpoint", "ar", tmp_path / "ckpt", "--max-shard-bytes", "0"), ("argument --max-shard-bytes", "expected a positive number of bytes, got 0")),
    Bad("make-checkpoint-dir-empty", lambda tmp_path: cli("make-checkpoint", "ar", ""), ("argument out_dir", "'' is an empty directory name")),
    Bad("plugin-report-dir-empty", pytest_session("parity/suites/selfcheck", "--parity-report-dir", ""), ("argument --parity-report-dir", "'' is an empty directory name")),
]
# fmt: on
EXIT = {
    **{row.id: 1 for row in ROWS},
    **dict.fromkeys(["case-file-broken-run-exit-4", "case-file-misspelt-run-exit-4", "plugin-report-dir-empty"], 4),
    **{row.id: 4 for row in ROWS if row.id.startswith("run-")},
    **{row.id: 2 for row in ROWS if row.id.startswith(("review-", "make-checkpoint-"))},
}


def test_the_table_covers_every_class_of_section_6() -> None:
    ids = [row.id for row in ROWS]
    assert len(set(ids)) == len(ids)
    for prefix in (
        "tolerance-",
        "grid-sizes",
        "case-file-",
        "ar-release-",
        "dit-release-",
        "inspect-",
        "run-",
        "review-",
        "make-checkpoint-",
    ):
        assert any(i.startswith(prefix) for i in ids), prefix


@pytest.mark.parametrize("row", [pytest.param(row, id=row.id, marks=row.marks) for row in ROWS])
def test_bad_input(row: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outcome = check_bad_input(row, tmp_path, monkeypatch)
    assert outcome.code == EXIT[row.id], f"documented exit {EXIT[row.id]}, got {outcome.code}:\n{outcome.output}"


# ---------------------------------------------------------------------------------------------
# The checks are what catch these: switched off (the broken variant), the mistake passes silently
# ---------------------------------------------------------------------------------------------


def _accept_any_value(patch: pytest.MonkeyPatch) -> None:
    patch.setattr("reference_models.ar.config.value_problem", lambda *a: None)  # the flat and the release reading


def _old_add_case_dirs(patch: pytest.MonkeyPatch) -> None:
    """`add_case_dirs` as it was: the directories are remembered, their files never looked at."""
    patch.setattr(parity.cases, "add_case_dirs", lambda dirs: setattr(parity.cases, "_extra_dirs", tuple(Path(d) for d in dirs)))


def _row(row_id: str) -> Bad:
    return next(row for row in ROWS if row.id == row_id)


@pytest.mark.parametrize(
    "row_id, switch_off",
    [
        ("tolerance-atol-1e308", lambda patch: patch.setattr(parity.cases, "FIELD_RANGES", {})),
        ("grid-sizes-multiply-past-limit", lambda patch: patch.setattr(parity.cases, "_check_elements", lambda record: None)),
        ("velocity-sizes-multiply-past-limit", lambda patch: patch.setattr(parity.cases, "MAX_CASE_ELEMENTS", math.inf)),
        ("case-file-misspelt-in-cases-dir", _old_add_case_dirs),
        ("ar-release-eps-negative-reference", _accept_any_value),
        ("ar-release-eps-negative-serving", lambda patch: patch.setattr("serving_models.ar.config.bad_value", lambda *a: None)),
        ("inspect-all-nan-tensor", lambda patch: patch.setattr("parity.tools.inspect_checkpoint.tensor_problems", lambda *a: [])),
        ("inspect-float8-tensor", lambda patch: patch.setattr("parity.tools.inspect_checkpoint.tensor_problems", lambda *a: [])),
        (
            "review-force-without-write-baseline",
            lambda patch: patch.setattr("parity.cli._review_options_problem", lambda args: None),
        ),
        ("review-margin-inf", lambda patch: patch.setattr("parity.cli._margin", float)),
        ("make-checkpoint-dir-empty", lambda patch: patch.setattr("parity.cli._directory", Path)),
    ],
)
def test_the_checks_are_what_catch_these(
    row_id: str, switch_off: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    if row_id == "make-checkpoint-dir-empty":  # without the check the checkpoint goes into the working directory
        monkeypatch.setattr("parity.tools.make_checkpoint.write_checkpoint", _no_checkpoint)
    row = _row(row_id)
    switch_off(monkeypatch)
    outcome = row.run(tmp_path)
    explaining = [line for line in outcome.output.splitlines() if all(word in line for word in row.expect)]
    assert outcome.code == 0 or not explaining, outcome.output


def _no_checkpoint(kind: str, size: str, seed: int, out_dir: Path, **options: Any) -> Path:
    return Path(out_dir)

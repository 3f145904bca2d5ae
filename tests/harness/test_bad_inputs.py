"""Bad input, as a user under pressure gives it: one clear line for every mistake, no silent pass,
no traceback, no finished row lost.

`BAD_INPUTS` is the table: each row makes one mistake (a case field out of range, a broken
checkpoint file, an option that cannot work, a torn or interrupted run under review, a target that
does not resolve or lacks a model family) and says which words the one line that explains it must
hold: what is wrong (file, option, key, tensor) and what was expected against what was found.
`test_bad_input` asserts for every row: a non-zero exit or a raised error (or a skip with its
reason where skipping is right), exactly one line of output holding all those words, no
`Traceback` / `INTERNALERROR`, and an existing run's `results.csv` byte-for-byte unchanged.

Rows run in-process (loaders, `parity.cli.main`, and pytest sessions of the suites for the plugin's
up-front checks and the skip of a family) unless the process is what is tested: an xdist session,
a `parity run` that starts its pytest, the device it picks. The Ctrl-C test sends SIGINT to a real
`parity run`. `test_the_checks_are_what_catch_these` shows rows going red when the check that
catches them is switched off.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from parity.cases import Table, add_case_dirs, load_case_file
from parity.cli import build_parser, main
from parity.compare import Tolerance, diff
from parity.observe.progress import communicate_watched, wait_for
from parity.report import RESULTS_FILE, ReportWriter, read_run_info, write_run_info
from tests.support.bad_input_table import Bad, Outcome, check_bad_input, cli, process, raised
from tests.support.helpers import PROJECT_ROOT, default_signals, run_parity, run_pytest_here, subprocess_env

# ---------------------------------------------------------------------------------------------
# What a row observes
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Case files: each row writes one table and loads it with that table's real record type
# ---------------------------------------------------------------------------------------------


def _record(kind: str) -> tuple[str, Table]:
    from parity.suites.ar.support import DecodeCase, Prompt
    from parity.suites.dit.support import ImageCase, VelocityCase
    from parity.suites.routing.cases import GridSpec, RankSpec
    from parity.suites.selfcheck.test_selfcheck import CosineCase, PsnrCase

    return {
        "tolerances": ("tolerances", Table(Tolerance, keyed=True)),
        "decode": ("decode", Table(DecodeCase)),
        "prompts": ("prompts", Table(Prompt)),
        "velocity": ("velocity", Table(VelocityCase)),
        "image": ("image", Table(ImageCase)),
        "grid": ("grid", Table(GridSpec, many=False)),
        "rank": ("rank", Table(RankSpec, many=False)),
        "psnr": ("psnr", Table(PsnrCase)),
        "cosine": ("cosine", Table(CosineCase)),
    }[kind]


GOOD = {
    "tolerances": '[tolerances.t]\natol = 1e-5\nrtol = 1e-6\nreason = "r"\n',
    "decode": '[[decode]]\nname = "d"\nprompt = [[3, 17, 42]]\nsteps = 8\nrequire_crossing = false\n',
    "prompts": '[[prompts]]\nname = "p"\nrows = [[3, 17, 42]]\n',
    "velocity": '[[velocity]]\nname = "v"\nsize = "tiny"\nheight = 32\nwidth = 32\ntext_lens = [4]\ntimestep = 0.5\nseed = 1\n',
    "image": (
        '[[image]]\nname = "i"\nsize = "tiny"\nheight = 32\nwidth = 32\ntext_len = 4\nsteps = 2\n'
        "guidance_scale = 4.0\ncfg_range = [0.0, 1.0]\nseed = 1\ntext_seed = 2\n"
    ),
    "grid": (
        '[grid]\nexperts = [8]\nk = [2]\nrows = [7]\ndtypes = ["fp32"]\nrenormalize = [true]\nkinds = ["softmax"]\n'
        "logit_std = 2.0\nseed = 1\ntie_flip_spacings = 2.0\n"
    ),
    "rank": '[rank]\ncapacity = 8\nexperts = 8\nhidden = 16\nk = 2\nkinds = ["softmax"]\nrenormalize = true\ntimeout_s = 60.0\nseed = 1\n',
    "psnr": '[[psnr]]\nname = "p"\ndata_range = 255.0\noffset = 1.0\nsize = 8\n',
    "cosine": '[[cosine]]\nname = "c"\na = [1.0, 0.0]\nb = [0.0, 1.0]\nexpected = 0.0\n',
}


def case_file(kind: str, old: str | None = None, new: str = "", *, text: str | None = None) -> Callable[[Path], Outcome]:
    """A row: the good table of `kind` with `old` replaced by `new` (or `text` verbatim), loaded."""

    def run(tmp_path: Path) -> Outcome:
        body = text if text is not None else GOOD[kind]
        if old is not None:
            assert old in body, f"{old!r} not in the {kind} table"
            body = body.replace(old, new, 1)
        path = tmp_path / f"{kind}.toml"
        path.write_text(body)
        name, table = _record(kind)
        return raised(lambda: load_case_file(path, {name: table}))

    return run


def case_bytes(data: bytes) -> Callable[[Path], Outcome]:
    def run(tmp_path: Path) -> Outcome:
        path = tmp_path / "decode.toml"
        path.write_bytes(data)
        name, table = _record("decode")
        return raised(lambda: load_case_file(path, {name: table}))

    return run


def missing_case_file(tmp_path: Path) -> Outcome:
    name, table = _record("decode")
    return raised(lambda: load_case_file(tmp_path / "nowhere.toml", {name: table}))


def duplicate_of_builtin(tmp_path: Path) -> Outcome:
    """`--parity-cases DIR` whose selfcheck.toml repeats a built-in case name."""
    (tmp_path / "selfcheck.toml").write_text('[[psnr]]\nname = "psnr-offset-uint8"\ndata_range = 255.0\noffset = 1.0\nsize = 8\n')
    from parity.suites.selfcheck import test_selfcheck

    schema = {"psnr": Table(test_selfcheck.PsnrCase)}
    add_case_dirs([tmp_path])
    try:
        return raised(lambda: load_case_file("selfcheck.toml", {**_selfcheck_schema(test_selfcheck), **schema}))
    finally:
        add_case_dirs([])


def _selfcheck_schema(module: Any) -> dict[str, Table]:
    return {
        "tolerances": Table(Tolerance, keyed=True),
        "psnr": Table(module.PsnrCase),
        "cosine": Table(module.CosineCase),
        "ulp": Table(module.UlpCase),
        "determinism": Table(module.DeterminismCase),
    }


def _case(kind: str, key: str, expected: str, found: str, table: str | None = None) -> tuple[str, ...]:
    expected = expected if expected.startswith("of length") else f"expected {expected}"
    return (f"{kind}.toml", f"[{table or kind}]", f"'{key}'", expected, f"found {found}")


# ---------------------------------------------------------------------------------------------
# Checkpoints: one tiny AR and one tiny DiT checkpoint per module, a copy broken per row
# ---------------------------------------------------------------------------------------------


@functools.cache
def _checkpoints(root: str) -> dict[str, Path]:
    from reference_models.checkpoints import make_checkpoint

    return {kind: make_checkpoint(kind, "tiny", 0, Path(root) / kind) for kind in ("ar", "dit")}


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


def _first_tensor(d: Path) -> tuple[dict[str, torch.Tensor], str]:
    tensors = load_file(d / "model.safetensors")
    return tensors, sorted(tensors)[0]


def _break_tensors(d: Path, change: Callable[[dict[str, torch.Tensor], str], None]) -> None:
    tensors, first = _first_tensor(d)
    change(tensors, first)
    save_file(tensors, d / "model.safetensors")


BREAKS: dict[str, Callable[[Path], None]] = {
    "config-not-json": lambda d: (d / "config.json").write_text("{not json"),
    "config-a-list": lambda d: (d / "config.json").write_text("[]"),
    "config-not-utf8": lambda d: (d / "config.json").write_bytes(b"\xff\xfe{}"),
    "config-missing": lambda d: (d / "config.json").unlink(),
    "config-key-str": lambda d: (d / "config.json").write_text(
        json.dumps({**json.loads((d / "config.json").read_text()), "num_hidden_layers": "2"})
    ),
    "config-dit-key-str": lambda d: (d / "config.json").write_text(
        json.dumps({**json.loads((d / "config.json").read_text()), "patch_size": "2"})
    ),
    "safetensors-garbage": lambda d: (d / "model.safetensors").write_bytes(b"garbage" * 10),
    "safetensors-cut": lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:4000]),
    "safetensors-missing": lambda d: (d / "model.safetensors").unlink(),
    "tensor-missing": lambda d: _break_tensors(d, lambda t, k: t.pop(k)),
    "tensor-extra": lambda d: _break_tensors(d, lambda t, k: t.__setitem__("extra.weight", torch.zeros(2))),
    "tensor-shape": lambda d: _break_tensors(d, lambda t, k: t.__setitem__(k, torch.zeros(3, 3))),
    "tensor-int": lambda d: _break_tensors(d, lambda t, k: t.__setitem__(k, t[k].to(torch.int32))),
}


def checkpoint(loader: str, broken: str) -> Callable[[Path], Outcome]:
    def run(tmp_path: Path) -> Outcome:
        source = _checkpoints(str(tmp_path.parent / "bad-input-checkpoints"))[loader.rsplit("-", 1)[1]]
        directory = tmp_path / "ckpt"
        shutil.copytree(source, directory)
        BREAKS[broken](directory)
        return raised(lambda: _loader(loader)(directory))

    return run


# ---------------------------------------------------------------------------------------------
# Tensors: comparisons, the reference's lookups, the serving MoE mask
# ---------------------------------------------------------------------------------------------


@functools.cache
def _reference_ar() -> Any:
    from reference_models.ar.adapter import ReferenceARAdapter
    from reference_models.ar.config import ar_config
    from reference_models.checkpoints import random_state_dict

    config = ar_config("tiny")
    return ReferenceARAdapter.build(config, random_state_dict(config, 0), "cpu", torch.float32)


def reference_embeds(token: int) -> Callable[[Path], Outcome]:
    return lambda tmp_path: raised(lambda: _reference_ar().embed(torch.tensor([[3, 17, token]])))


def _experts() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)


def moe(mask: Callable[[], torch.Tensor], *, capturing: bool = False) -> Callable[[Path], Outcome]:
    """`moe_dispatch` of the serving model on [2, 5, 8] rows with a bad mask, eagerly or as under capture."""

    def run(tmp_path: Path) -> Outcome:
        from serving_models.ar import model

        und, gen = _experts()
        hidden = torch.randn(2, 5, 8)
        if capturing:
            return raised(lambda: model.moe_blend(hidden, und, gen, mask()))
        return raised(lambda: model.moe_dispatch(hidden, und, gen, mask(), "model.layers.1"))

    return run


def compare(ref: torch.Tensor, cand: torch.Tensor) -> Callable[[Path], Outcome]:
    return lambda tmp_path: raised(lambda: diff(ref, cand, Tolerance(1e-5, 0.0, "test"), name="logits"))


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------


def target(spec: str) -> Callable[[Path], Outcome]:
    from parity.target import resolve_target

    return lambda tmp_path: raised(lambda: resolve_target(spec, option="--parity-target"))


def target_module(name: str, source: str) -> Callable[[Path], Outcome]:
    """`--parity-target <name>:make_target` where the module `<name>` holds `source`."""

    def run(tmp_path: Path) -> Outcome:
        from parity.target import resolve_target

        (tmp_path / f"{name}.py").write_text(source)
        sys.path.insert(0, str(tmp_path))
        try:
            return raised(lambda: resolve_target(f"{name}:make_target", option="--parity-target"))
        finally:
            sys.path.remove(str(tmp_path))
            sys.modules.pop(name, None)

    return run


def family(factory: str, family_name: str) -> Callable[[Path], Outcome]:
    """The skip a target without a model family gets (the suites' conftest skips with this reason)."""

    def run(tmp_path: Path) -> Outcome:
        from parity.target import family_gap, resolve_target

        reason = family_gap(resolve_target(factory), family_name)
        return Outcome(0, "", skipped=reason or "")

    return run


# ---------------------------------------------------------------------------------------------
# Runs and reviews: a small run directory written as the plugin writes one
# ---------------------------------------------------------------------------------------------

CONTEXT = {"run_id": "r", "target": "serving", "device": "cpu", "dtype": "fp32", "size": "tiny"}


def make_run(run_dir: Path, *, status: str = "complete", context: dict[str, str] | None = None, **info: Any) -> Path:
    context = {**CONTEXT, **(context or {}), "run_id": run_dir.name}
    run_info = {"run_id": run_dir.name, "status": status, "pid": os.getpid(), "host": os.uname().nodename, "seed": 0, **info}
    run_info.update({k: context[k] for k in ("device", "dtype", "size", "target")})
    writer = ReportWriter(run_dir, context, on_create=lambda d: write_run_info(d, run_info))
    for i in range(4):
        writer.write(
            {"suite": "selfcheck", "case": f"c{i}", "metric": "max_abs", "value": 0.1 * i, "threshold": 1.0, "verdict": "pass"}
        )
    return run_dir


def review(
    prepare: Callable[[Path], Path], *extra: str, baseline: Callable[[Path], Path] | None = None
) -> Callable[[Path], Outcome]:
    """`parity review RUN_DIR` of a run `prepare` made (and broke); checks its rows are kept."""

    def run(tmp_path: Path) -> Outcome:
        run_dir = prepare(tmp_path)
        results = run_dir / RESULTS_FILE
        before = results.read_bytes() if results.is_file() else None
        args = ["review", str(run_dir), *extra]
        args += (
            ["--baseline", str(baseline(tmp_path))]
            if baseline is not None
            else ([] if "--baseline" in extra else ["--no-baseline"])
        )
        outcome = cli(*args)
        outcome.preserved = None if before is None else results.read_bytes() == before
        return outcome

    return run


def run_with(**info: Any) -> Callable[[Path], Path]:
    return lambda tmp_path: make_run(tmp_path / "run", **info)


def results_text(text: str | bytes) -> Callable[[Path], Path]:
    """A run directory whose results.csv is replaced by `text` (run.json says complete)."""

    def prepare(tmp_path: Path) -> Path:
        run_dir = make_run(tmp_path / "run")
        path = run_dir / RESULTS_FILE
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return run_dir

    return prepare


def torn(tmp_path: Path) -> Path:
    """The last record cut in the middle of a field (a write that stopped half-way)."""
    run_dir = make_run(tmp_path / "run")
    path = run_dir / RESULTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[: data.rstrip(b"\n").rfind(b"\n") + 40])
    return run_dir


def empty_with_header(tmp_path: Path) -> Path:
    run_dir = make_run(tmp_path / "run")
    path = run_dir / RESULTS_FILE
    path.write_text(path.read_text().splitlines()[0] + "\n")
    return run_dir


def no_run_info(tmp_path: Path) -> Path:
    run_dir = make_run(tmp_path / "run")
    (run_dir / "run.json").unlink()
    return run_dir


def dead_process() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def baseline_of(**changes: str) -> Callable[[Path], Path]:
    """A baseline CSV of the same rows for another configuration (in a `baselines/` directory)."""

    def make(tmp_path: Path) -> Path:
        from parity.report.baseline import load_rows, write_baseline

        other = make_run(tmp_path / "other", context={**CONTEXT, **changes})
        return write_baseline(load_rows(other), tmp_path / "baselines" / f"{changes.get('device', 'cpu')}-other.csv")

    return make


def cuda_run(device_name: str) -> Callable[[Path], Path]:
    return lambda tmp_path: make_run(tmp_path / "run", context={**CONTEXT, "device": "cuda"}, device_name=device_name)


def h200_baseline(tmp_path: Path) -> Path:
    from parity.report.baseline import load_rows, write_baseline

    other = make_run(tmp_path / "other", context={**CONTEXT, "device": "cuda"}, device_name="NVIDIA H200")
    return write_baseline(load_rows(other), tmp_path / "baselines" / "h200-fp32.csv")


def header_only_baseline(tmp_path: Path) -> Path:
    from parity.report.baseline import BASELINE_COLUMNS

    path = tmp_path / "baselines" / "cpu-fp32.csv"
    path.parent.mkdir(parents=True)
    path.write_text(",".join(BASELINE_COLUMNS) + "\n")
    return path


def existing_run(*args: str) -> Callable[[Path], Outcome]:
    """`parity run --run-id r` into a report directory that already holds run `r`."""

    def run(tmp_path: Path) -> Outcome:
        run_dir = make_run(tmp_path / "reports" / "r")
        before = (run_dir / RESULTS_FILE).read_bytes()
        outcome = cli("run", "--report-dir", tmp_path / "reports", "--run-id", "r", "--suite", "selfcheck", *args)
        outcome.preserved = (run_dir / RESULTS_FILE).read_bytes() == before
        return outcome

    return run


def parity_run(*args: str) -> Callable[[Path], Outcome]:
    """`parity run` in-process, for options it refuses before pytest starts."""
    return lambda tmp_path: cli("run", "--report-dir", tmp_path / "reports", "--suite", "selfcheck", *args)


def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory\n")
    return path


def cpu_threads(value: str) -> Callable[[Path], Outcome]:
    def run(tmp_path: Path) -> Outcome:
        from parity.plugin import lanes

        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(lanes.CPU_THREADS_ENV, value)
            return raised(lanes.cpu_threads)

    return run


# ---------------------------------------------------------------------------------------------
# Past the CLI: a pytest session of the suites in this process (the plugin's up-front checks, the
# skips of a family: one session's work), a fresh process where the process is what is tested
# (xdist, a `parity run` that starts its pytest, its device)
# ---------------------------------------------------------------------------------------------


def suites_session(*args: str, skips: bool = False) -> Callable[[Path], Outcome]:
    """`pytest ARGS` (paths relative to the repository) as an in-process session: about 10 s less
    than a fresh interpreter, the same exit status and output. A session to be refused (every row
    but a family's skips) ends at any test that starts: its refusal must come before the tests."""

    def run(tmp_path: Path) -> Outcome:
        report_dir = [] if "--parity-report-dir" in args else ["--parity-report-dir", str(tmp_path / "reports")]
        paths = [str(PROJECT_ROOT / a) if a.startswith("parity/") else a for a in args]
        command = [*paths, *report_dir, "-q", "-rs"]
        outcome = Outcome(*run_pytest_here(command, basetemp=tmp_path / "basetemp", refused=not skips))
        if skips:
            # a skipped test, or a family the target does not provide: left out, one line under the summary
            outcome.skipped = "\n".join(line for line in outcome.output.splitlines() if line.startswith(("SKIPPED", "not run: ")))
        return outcome

    return run


def fresh_parity_run(*args: str) -> Callable[[Path], Outcome]:
    def run(tmp_path: Path) -> Outcome:
        outcome = process(run_parity(["run", "--report-dir", str(tmp_path / "reports"), *args]))
        left = list((tmp_path / "reports").iterdir()) if (tmp_path / "reports").is_dir() else []
        outcome.output += "".join(f"\nleft a run directory: {p}" for p in left if p.is_dir())
        return outcome

    return run


def fresh_append(*args: str, run_target: str = "serving") -> Callable[[Path], Outcome]:
    """`parity run --run-id r --append ...` to a complete run `r` of `run_target`: refused before
    any test, and the run (rows and run.json) is as it was."""

    def run(tmp_path: Path) -> Outcome:
        run_dir = make_run(tmp_path / "reports" / "r", context={**CONTEXT, "target": run_target})
        before = (run_dir / RESULTS_FILE).read_bytes(), (run_dir / "run.json").read_bytes()
        command = ["run", "--report-dir", str(tmp_path / "reports"), "--run-id", "r", "--append", "--suite", "selfcheck", *args]
        outcome = process(run_parity(command))
        outcome.preserved = ((run_dir / RESULTS_FILE).read_bytes(), (run_dir / "run.json").read_bytes()) == before
        return outcome

    return run


HAS_CUDA = torch.cuda.is_available()

# ---------------------------------------------------------------------------------------------
# The table: (id, what the user did, the words the one explaining line must hold)
# ---------------------------------------------------------------------------------------------


FINITE = "a finite float"
# fmt: off
BAD_INPUTS = [
    # -- case files: NaN / inf / negative / zero / huge in every kind of field -------------------
    Bad("tolerance-atol-nan", case_file("tolerances", "atol = 1e-5", "atol = nan"), _case("tolerances", "atol", FINITE, "float nan", "tolerances.t")),
    Bad("tolerance-rtol-nan", case_file("tolerances", "rtol = 1e-6", "rtol = nan"), _case("tolerances", "rtol", FINITE, "float nan", "tolerances.t")),
    Bad("tolerance-atol-inf", case_file("tolerances", "atol = 1e-5", "atol = inf"), _case("tolerances", "atol", FINITE, "float inf", "tolerances.t")),
    Bad("tolerance-rtol-minus-inf", case_file("tolerances", "rtol = 1e-6", "rtol = -inf"), _case("tolerances", "rtol", FINITE, "float -inf", "tolerances.t")),
    Bad("tolerance-atol-negative", case_file("tolerances", "atol = 1e-5", "atol = -1e-5"), ("tolerances.toml", "[tolerances.t]", "finite and non-negative", "atol=-1e-05")),
    Bad("tolerance-nan-in-code", lambda tmp_path: raised(lambda: Tolerance(math.nan, 0.0, "x")), ("ValueError", "finite and non-negative", "atol=nan")),
    Bad("tolerance-no-reason", case_file("tolerances", 'reason = "r"', 'reason = " "'), ("tolerances.toml", "[tolerances.t]", "a tolerance needs a stated reason")),
    Bad("decode-steps-zero", case_file("decode", "steps = 8", "steps = 0"), _case("decode", "steps", "int in [1, 4096]", "int 0")),
    Bad("decode-steps-negative", case_file("decode", "steps = 8", "steps = -5"), _case("decode", "steps", "int in [1, 4096]", "int -5")),
    Bad("decode-steps-huge", case_file("decode", "steps = 8", "steps = 1000000000"), _case("decode", "steps", "int in [1, 4096]", "int 1000000000")),
    Bad("decode-steps-float", case_file("decode", "steps = 8", "steps = 8.5"), _case("decode", "steps", "int", "float 8.5")),
    Bad("decode-steps-string", case_file("decode", "steps = 8", 'steps = "8"'), _case("decode", "steps", "int", "str '8'")),
    Bad("decode-crossing-int", case_file("decode", "require_crossing = false", "require_crossing = 0"), _case("decode", "require_crossing", "bool", "int 0")),
    Bad("decode-missing-steps", case_file("decode", "steps = 8\n", ""), _case("decode", "steps", "int in [1, 4096]", "nothing (missing field)")),
    Bad("decode-unknown-key", case_file("decode", "steps = 8", "steps = 8\nstep = 9"), _case("decode", "step", "one of the keys name, prompt, steps", "unknown key 'step'")),
    Bad("prompt-batch-zero", case_file("prompts", "rows = [[3, 17, 42]]", "rows = []"), _case("prompts", "rows", "of length in [1, 64]", "length 0")),
    Bad("prompt-empty-sequence", case_file("prompts", "rows = [[3, 17, 42]]", "rows = [[]]"), _case("prompts", "rows[0]", "of length in [1, 8192]", "length 0")),
    Bad("prompt-huge-sequence", case_file("prompts", "rows = [[3, 17, 42]]", f"rows = [[{', '.join(['3'] * 9000)}]]"), _case("prompts", "rows[0]", "of length in [1, 8192]", "length 9000")),
    Bad("prompt-huge-batch", case_file("prompts", "rows = [[3, 17, 42]]", f"rows = [{', '.join(['[3]'] * 65)}]"), _case("prompts", "rows", "of length in [1, 64]", "length 65")),
    Bad("prompt-ragged-batch", case_file("prompts", "rows = [[3, 17, 42]]", "rows = [[3, 17, 42], [5]]"), ("prompts.toml", "[prompts] case 'p'", "one length", "lengths [1, 3]")),
    Bad("prompt-token-float", case_file("prompts", "rows = [[3, 17, 42]]", "rows = [[3, 17.5]]"), _case("prompts", "rows[0][1]", "int | str", "float 17.5")),
    Bad("case-name-duplicate", case_file("prompts", text=GOOD["prompts"] * 2), ("prompts.toml", "[prompts] case 'p'", "expected a unique case name", "found a duplicate 'p'")),
    Bad("case-name-slash", case_file("prompts", 'name = "p"', 'name = "../../x"'), ("prompts.toml", "'name'", "expected a plain name", "found str '../../x'")),
    Bad("case-name-dotdot", case_file("velocity", 'name = "v"', 'name = ".."'), ("velocity.toml", "'name'", "expected a plain name", "found str '..'")),
    Bad("case-name-of-builtin-again", duplicate_of_builtin, ("selfcheck.toml", "'psnr-offset-uint8'", "a case of that name is already in")),
    Bad("velocity-height-zero", case_file("velocity", "height = 32", "height = 0"), _case("velocity", "height", "int in [1, 1024]", "int 0")),
    Bad("velocity-width-huge", case_file("velocity", "width = 32", "width = 100000"), _case("velocity", "width", "int in [1, 1024]", "int 100000")),
    Bad("velocity-timestep-nan", case_file("velocity", "timestep = 0.5", "timestep = nan"), _case("velocity", "timestep", FINITE, "float nan")),
    Bad("velocity-timestep-past-one", case_file("velocity", "timestep = 0.5", "timestep = 1.5"), _case("velocity", "timestep", "float in [0, 1]", "float 1.5")),
    Bad("velocity-batch-zero", case_file("velocity", "text_lens = [4]", "text_lens = []"), _case("velocity", "text_lens", "of length in [1, 64]", "length 0")),
    Bad("velocity-text-negative", case_file("velocity", "text_lens = [4]", "text_lens = [-1]"), _case("velocity", "text_lens[0]", "int in [0, 4096]", "int -1")),
    Bad("velocity-text-huge", case_file("velocity", "text_lens = [4]", "text_lens = [1000000]"), _case("velocity", "text_lens[0]", "int in [0, 4096]", "int 1000000")),
    Bad("velocity-seed-negative", case_file("velocity", "seed = 1", "seed = -1"), _case("velocity", "seed", "int in [0, 4294967295]", "int -1")),
    Bad("velocity-size-unknown", case_file("velocity", 'size = "tiny"', 'size = "huge"'), _case("velocity", "size", "'tiny' | 'full'", "str 'huge'")),
    Bad("image-guidance-inf", case_file("image", "guidance_scale = 4.0", "guidance_scale = inf"), _case("image", "guidance_scale", FINITE, "float inf")),
    Bad("image-steps-zero", case_file("image", "steps = 2", "steps = 0"), _case("image", "steps", "int in [1, 4096]", "int 0")),
    Bad("image-cfg-range-short", case_file("image", "cfg_range = [0.0, 1.0]", "cfg_range = [0.0]"), _case("image", "cfg_range", "tuple[float in [0, 1], float in [0, 1]] of length 2", "array [0.0]")),
    Bad("grid-rows-negative", case_file("grid", "rows = [7]", "rows = [-1]"), _case("grid", "rows[0]", "int in [0, 1048576]", "int -1")),
    Bad("grid-experts-zero", case_file("grid", "experts = [8]", "experts = [0]"), _case("grid", "experts[0]", "int in [1, 1048576]", "int 0")),
    Bad("grid-logit-std-nan", case_file("grid", "logit_std = 2.0", "logit_std = nan"), _case("grid", "logit_std", FINITE, "float nan")),
    Bad("grid-dtype-unknown", case_file("grid", 'dtypes = ["fp32"]', 'dtypes = ["fp8"]'), _case("grid", "dtypes[0]", "'fp32' | 'bf16' | 'fp16'", "str 'fp8'")),
    Bad("rank-timeout-zero", case_file("rank", "timeout_s = 60.0", "timeout_s = 0.0"), _case("rank", "timeout_s", "float in [0.001, 3600]", "float 0.0")),
    Bad("psnr-data-range-zero", case_file("psnr", "data_range = 255.0", "data_range = 0.0"), _case("psnr", "data_range", "float >= 1e-06", "float 0.0")),
    Bad("cosine-expected-past-one", case_file("cosine", "expected = 0.0", "expected = 2.0"), _case("cosine", "expected", "float in [-1, 1]", "float 2.0")),
    Bad("case-table-wrong-type", case_file("prompts", text="prompts = 3\n"), ("prompts.toml", "[prompts]", "expected [[...]] array of Prompt", "found int 3")),
    Bad("case-unknown-table", case_file("decode", text=GOOD["decode"] + "[[decodes]]\nname = 'x'\n"), ("decode.toml", "[decodes]", "unknown table; expected one of [decode]")),
    Bad("case-file-invalid-toml", case_file("decode", text="[[decode]\nname = 'x'\n"), ("decode.toml", "invalid TOML", "line 1")),
    Bad("case-file-not-utf8", case_bytes(b'[[decode]]\nname = "d\xe9"\n'), ("decode.toml", "not UTF-8 text", "line 2", "b'\\xe9'")),
    Bad("case-file-missing", missing_case_file, ("nowhere.toml", "case file not found")),
    # -- checkpoints: the file and the tensor named, expected against found ---------------------
    Bad("ar-config-not-json", checkpoint("serving-ar", "config-not-json"), ("config.json", "not valid JSON", "line 1 column 2")),
    Bad("ar-config-a-list", checkpoint("serving-ar", "config-a-list"), ("config.json", "expected a JSON object, found list")),
    Bad("ar-config-not-utf8", checkpoint("reference-ar", "config-not-utf8"), ("config.json", "not UTF-8 text", "b'\\xff'")),
    Bad("ar-config-missing", checkpoint("serving-ar", "config-missing"), ("ckpt", "no config.json")),
    Bad("ar-config-key-str", checkpoint("serving-ar", "config-key-str"), ("config.json", "'num_hidden_layers'", "expected int", "found str '2'")),
    Bad("ar-config-key-str-reference", checkpoint("reference-ar", "config-key-str"), ("config.json", "'num_hidden_layers'", "expected int", "found str '2'")),
    Bad("dit-config-key-str", checkpoint("serving-dit", "config-dit-key-str"), ("config.json", "'patch_size'", "expected int", "found str '2'")),
    Bad("dit-config-a-list", checkpoint("reference-dit", "config-a-list"), ("config.json", "expected a JSON object, found list")),
    Bad("ar-safetensors-garbage", checkpoint("serving-ar", "safetensors-garbage"), ("model.safetensors", "not a readable safetensors file", "header too large")),
    Bad("ar-safetensors-cut", checkpoint("reference-ar", "safetensors-cut"), ("model.safetensors", "not a readable safetensors file")),
    Bad("dit-safetensors-cut", checkpoint("serving-dit", "safetensors-cut"), ("model.safetensors", "not a readable safetensors file")),
    Bad("dit-safetensors-missing", checkpoint("reference-dit", "safetensors-missing"), ("ckpt", "neither model.safetensors nor model.safetensors.index.json")),
    Bad("ar-tensor-missing", checkpoint("serving-ar", "tensor-missing"), ("ckpt", "does not match the serving model", "missing 1 tensor(s): gen_head.weight")),
    Bad("ar-tensor-extra", checkpoint("reference-ar", "tensor-extra"), ("ckpt", "does not match the model", "unexpected 1 tensor(s): extra.weight")),
    Bad("ar-tensor-shape", checkpoint("serving-ar", "tensor-shape"), ("ckpt", "wrong shape: gen_head.weight", "expected [64, 64], got [3, 3]")),
    Bad("ar-tensor-int", checkpoint("reference-ar", "tensor-int"), ("ckpt", "tensor gen_head.weight", "expected a floating-point dtype, found torch.int32")),
    Bad("dit-tensor-missing", checkpoint("reference-dit", "tensor-missing"), ("ckpt", "does not fit the model", "missing (1): context_refiner.0.attn.norm_k.weight")),
    Bad("dit-tensor-extra", checkpoint("serving-dit", "tensor-extra"), ("ckpt", "does not fit the serving Transformer2DModel", "unexpected (1): extra.weight")),
    Bad("dit-tensor-shape", checkpoint("serving-dit", "tensor-shape"), ("ckpt", "context_refiner.0.attn.norm_k.weight: expected (24,), got (3, 3)")),
    Bad("dit-tensor-int", checkpoint("serving-dit", "tensor-int"), ("ckpt", "context_refiner.0.attn.norm_k.weight", "expected a floating-point dtype, found torch.int32")),
    # -- tensors: comparisons, the reference's tables, the serving MoE mask ----------------------
    Bad("compare-shapes", compare(torch.zeros(2, 3), torch.zeros(2, 4)), ("logits", "shape mismatch", "reference (2, 3) vs candidate (2, 4)")),
    Bad("compare-int-candidate", compare(torch.zeros(3), torch.zeros(3, dtype=torch.int64)), ("logits", "dtype mismatch", "reference torch.float32 vs candidate torch.int64")),
    Bad("reference-id-minus-one", reference_embeds(-1), ("IndexError", "token id -1 at position [0, 2]", "embed_tokens (256 rows: ids 0..255)")),
    Bad("reference-id-past-gen", reference_embeds(320), ("IndexError", "token id 320 at position [0, 2]", "gen_embed_tokens (64 rows: ids 256..319)")),
    Bad("reference-id-huge", reference_embeds(2 ** 40), ("IndexError", f"token id {2 ** 40}", "gen_embed_tokens")),
    Bad("moe-mask-short-eager", moe(lambda: torch.ones(2, 4, dtype=torch.bool)), ("gen_token_mask (2, 4) torch.bool", "hidden_states (2, 5, 8)", "shape (2, 5)")),
    Bad("moe-mask-broadcast-blend", moe(lambda: torch.ones(2, 1, dtype=torch.bool), capturing=True), ("gen_token_mask (2, 1)", "shape (2, 5)")),
    Bad("moe-mask-int", moe(lambda: torch.ones(2, 5, dtype=torch.int64)), ("gen_token_mask (2, 5) torch.int64", "one torch.bool entry per row")),
    # -- targets ---------------------------------------------------------------------------------
    Bad("target-no-module", target("bogus.mod:f"), ("--parity-target 'bogus.mod:f'", "cannot import module 'bogus.mod'", "No module named 'bogus'")),
    Bad("target-no-colon", target("serving_models.target"), ("--parity-target 'serving_models.target'", "expected one of serving, reference or 'package.module:factory'")),
    Bad("target-path-unsafe", target("../x:f"), ("--parity-target '../x:f'", "'package.module:factory'")),
    Bad("target-no-factory", target("serving_models.target:nope"), ("'serving_models.target:nope'", "has no callable 'nope' (found nothing)")),
    Bad("target-not-callable", target("tests.support.bad_targets:NOT_CALLABLE"), ("has no callable 'NOT_CALLABLE' (found int)",)),
    Bad("target-factory-raises", target("tests.support.bad_targets:raises"), ("the factory tests.support.bad_targets:raises raised RuntimeError", "weights path is not set | (set ENGINE_WEIGHTS)")),
    Bad("target-without-name", target("tests.support.bad_targets:nameless"), ("the factory returned _Nameless without a 'name'",)),
    Bad("target-syntax-error", target_module("engine_syntax", "def make_target(:\n    pass\n"), ("'engine_syntax:make_target'", "importing module 'engine_syntax' raised SyntaxError", "engine_syntax.py, line 1")),
    Bad("target-raises-on-import", target_module("engine_no_gpu", "raise OSError('libcuda.so.1: cannot open shared object file')\n"), ("'engine_no_gpu:make_target'", "importing module 'engine_no_gpu' raised OSError: libcuda.so.1")),
    Bad("target-missing-dependency", target_module("engine_deps", "import vllm_not_installed\n"), ("cannot import module 'engine_deps'", "No module named 'vllm_not_installed'")),
    Bad("target-without-router", family("tests.support.bad_targets:no_router", "routing"), ("target 'serving-without-router' provides no router (no router)",), skip=True),
    Bad("target-without-dit", family("tests.support.bad_targets:no_dit", "dit"), ("provides no DiT (no load_dit, build_dit)",), skip=True),
    Bad("target-without-ar", family("tests.support.bad_targets:no_ar", "ar"), ("provides no AR backbone (no load_ar, build_ar)",), skip=True),
    # -- options of `parity run` (refused before pytest starts) ------------------------------------
    Bad("device-unknown", parity_run("--device", "tpu"), ("argument --device", "invalid choice: 'tpu'", "choose from")),
    Bad("size-unknown", parity_run("--size", "huge"), ("argument --size", "invalid choice: 'huge'")),
    Bad("dtype-unknown", parity_run("--dtype", "fp8"), ("argument --dtype", "invalid choice: 'fp8'")),
    Bad("seed-not-int", parity_run("--seed", "abc"), ("argument --seed", "invalid int value: 'abc'")),
    Bad("seed-negative", parity_run("--seed", "-1"), ("--seed -1", "expected an integer in [0, 2147483647]")),
    Bad("run-id-escapes", parity_run("--run-id", "../../x"), ("--run-id '../../x'", "expected a plain name")),
    Bad("run-id-slash", parity_run("--run-id", "a/b"), ("--run-id 'a/b'", "expected a plain name")),
    Bad("run-id-dotdot", parity_run("--run-id", ".."), ("--run-id '..'", "expected a plain name")),
    Bad("run-id-hidden", parity_run("--run-id", ".hidden"), ("--run-id '.hidden'", "expected a plain name")),
    Bad("run-id-exists", existing_run(), ("--run-id 'r'", "already holds a run (status complete, 4 row(s))", "--overwrite", "--append")),
    Bad("overwrite-and-append", existing_run("--overwrite", "--append"), ("--overwrite and --append contradict each other",)),
    Bad("report-dir-under-a-file", lambda tmp_path: cli("run", "--report-dir", a_file(tmp_path) / "sub", "--suite", "selfcheck"), ("--report-dir", "a-file/sub", "cannot write run directories there (Not a directory)")),
    Bad("report-dir-a-file", lambda tmp_path: cli("run", "--report-dir", a_file(tmp_path), "--suite", "selfcheck"), ("--report-dir", "a-file", "cannot write run directories there")),
    Bad("cpu-threads-zero", cpu_threads("0"), ("PARITY_CPU_THREADS='0'", "expected a positive integer")),
    Bad("cpu-threads-text", cpu_threads("two"), ("PARITY_CPU_THREADS='two'", "expected a positive integer")),
    # -- reviews: incomplete, torn, unreadable runs; baselines of another configuration -----------
    Bad("review-empty-results", review(results_text("")), ("results.csv", "empty (no header, no rows)")),
    Bad("review-header-only", review(empty_with_header), ("results.csv", "no rows to review")),
    Bad("review-torn-last-line", review(torn), ("INCOMPLETE RUN", "results.csv: 1 torn record(s) at line(s) 5")),
    Bad("review-interrupted-sigint", review(run_with(status="interrupted", signal="SIGINT")), ("INCOMPLETE RUN", "the run was interrupted (SIGINT)")),
    Bad("review-interrupted-sigterm", review(run_with(status="interrupted", signal="SIGTERM")), ("INCOMPLETE RUN", "the run was interrupted (SIGTERM)")),
    Bad("review-stopped-early", review(run_with(status="interrupted", reason="stopped early: stopping after 1 failures")), ("INCOMPLETE RUN", "stopped early: stopping after 1 failures")),
    Bad("review-crashed", review(run_with(status="crashed", reason="pytest internal error")), ("INCOMPLETE RUN", "the run was crashed (pytest internal error)")),
    Bad("review-died-running", lambda tmp_path: review(run_with(status="running", pid=dead_process()))(tmp_path), ("INCOMPLETE RUN", "says running but process", "is gone")),
    Bad("review-no-status", review(run_with(status=None)), ("INCOMPLETE RUN", "run.json records no status")),
    Bad("review-no-run-json", review(no_run_info), ("INCOMPLETE RUN", "no run.json: whether the run completed is unknown")),
    Bad("review-earlier-session-interrupted", review(run_with(previous_sessions=[{"status": "interrupted", "signal": "SIGINT"}])), ("INCOMPLETE RUN", "earlier session 1 of this run (appended to) was interrupted (SIGINT)")),
    Bad("review-baseline-from-interrupted", review(run_with(status="interrupted", signal="SIGINT"), "--no-baseline", "--write-baseline", "b.csv"), ("refusing to write a baseline from an incomplete run", "interrupted (SIGINT)")),
    Bad("review-results-not-utf8", review(results_text(b"run_id,suite\n\xff\xfe\n")), ("results.csv", "not UTF-8 text")),
    Bad("review-results-not-parity", review(results_text("a,b\n1,2\n")), ("results.csv", "not a parity results file, missing columns")),
    Bad("review-run-json-broken", review(lambda tmp_path: _broken_run_json(tmp_path)), ("run.json", "not valid JSON")),
    Bad("review-no-run-dir", lambda tmp_path: cli("review", tmp_path / "nowhere"), ("nowhere", "is not a run directory")),
    Bad("review-margin-negative", review(run_with(), "--margin", "-1", baseline=baseline_of()), ("margin must be a non-negative fraction of the bound, got -1.0",)),
    Bad("review-margin-nan", review(run_with(), "--margin", "nan", baseline=baseline_of()), ("margin must be a non-negative fraction of the bound, got nan",)),
    Bad("baseline-other-device", review(run_with(), baseline=baseline_of(device="cuda")), ("was made for device=cuda dtype=fp32 size=tiny", "this run is device=cpu")),
    Bad("baseline-other-dtype", review(run_with(), baseline=baseline_of(dtype="bf16")), ("was made for device=cpu dtype=bf16", "this run is device=cpu dtype=fp32")),
    Bad("baseline-other-size", review(run_with(), baseline=baseline_of(size="full")), ("size=full", "this run is device=cpu dtype=fp32 size=tiny")),
    Bad("baseline-other-target", review(run_with(), baseline=baseline_of(target="reference")), ("target=reference", "target=serving")),
    Bad("baseline-other-gpu", review(cuda_run("NVIDIA A100-SXM4-80GB"), baseline=h200_baseline), ("made on device kind h200", "this run on a100-sxm4-80gb")),
    Bad("baseline-without-rows", review(run_with(), baseline=header_only_baseline), ("cpu-fp32.csv", "no rows (nothing to compare with)")),
    Bad("baseline-missing", review(run_with(), "--baseline", "/nonexistent/cpu-fp32.csv"), ("no report rows at /nonexistent/cpu-fp32.csv",)),
    # -- pytest sessions of the suites, in-process: the plugin's up-front checks, a family's skips --
    Bad("target-bogus-pytest", suites_session("parity/suites", "--parity-suite", "selfcheck", "--parity-target", "bogus.mod:f"), ("ERROR: --parity-target 'bogus.mod:f'", "No module named 'bogus'")),
    Bad("suite-unknown", suites_session("parity/suites", "--parity-suite", "numerix"), ("ERROR: --parity-suite 'numerix'", "suites: benchmark, decode, embedding_clamp", "selfcheck")),
    Bad("report-dir-unwritable-plugin", suites_session("parity/suites", "--parity-suite", "selfcheck", "--parity-report-dir", "/proc/parity-reports"), ("ERROR: --parity-report-dir /proc/parity-reports", "cannot write run directories there")),
    Bad("target-without-router-run", suites_session("parity/suites/routing/test_edges.py", "--parity-target", "tests.support.bad_targets:no_router", skips=True), ("provides no router (no router): the routing suites do not apply",), skip=True),
    # -- in a fresh process: xdist, and `parity run` past its own checks (its pytest, its device) ---
    Bad("target-bogus-xdist", fresh_parity_run("--suite", "selfcheck", "--target", "bogus.mod:f", "-n", "2"), ("ERROR: --parity-target 'bogus.mod:f'", "No module named 'bogus'"), marks=(pytest.mark.parity_slow,)),
    Bad("append-target-gone", fresh_append("--target", "bogus.mod:f", run_target="bogus.mod:f"), ("ERROR: --parity-target 'bogus.mod:f'", "No module named 'bogus'"), marks=(pytest.mark.parity_slow,)),
    Bad("append-other-target", fresh_append("--target", "reference"), ("parity run: --append --run-id 'r'", "another configuration", "target: run has 'serving', this session 'reference'"), marks=(pytest.mark.parity_slow,)),
    Bad("cuda-on-a-cpu-machine", fresh_parity_run("--device", "cuda", "--suite", "selfcheck"), ("ERROR: --parity-device cuda: no CUDA device is available",), marks=(pytest.mark.parity_slow, pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA"),)),
]
# fmt: on


def _broken_run_json(tmp_path: Path) -> Path:
    run_dir = make_run(tmp_path / "run")
    (run_dir / "run.json").write_text("{status: complete")
    return run_dir


def test_the_table_has_what_the_issue_asks() -> None:
    assert len(BAD_INPUTS) >= 60
    ids = [row.id for row in BAD_INPUTS]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("row", [pytest.param(row, id=row.id, marks=row.marks) for row in BAD_INPUTS])
def test_bad_input(row: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check_bad_input(row, tmp_path, monkeypatch)


def test_a_review_with_allow_incomplete_reviews_the_whole_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torn run again: --allow-incomplete reviews the 3 whole rows (exit 0) and still says it is torn."""
    monkeypatch.chdir(tmp_path)
    run_dir = torn(tmp_path)
    outcome = cli("review", run_dir, "--no-baseline", "--allow-incomplete")
    assert outcome.code == 0, outcome.output
    assert "INCOMPLETE RUN: " in outcome.output and "the 3 whole rows" in outcome.output
    assert "selfcheck      3" in outcome.output


# ---------------------------------------------------------------------------------------------
# The checks are what catch these: switched off, rows of the table go red
# ---------------------------------------------------------------------------------------------


def _no_problems(self: Any) -> Any:
    """`Records.check` switched off: the file's whole rows, no record cut short."""
    from parity.report import ResultsCheck

    return ResultsCheck(self.path, len(self.whole))


def _old_tolerance_check(self: Tolerance) -> None:
    """`Tolerance.__post_init__` as it was: `atol < 0` is False for NaN."""
    if self.atol < 0 or self.rtol < 0:
        raise ValueError("tolerance must be non-negative")


def _accept_nan(patch: pytest.MonkeyPatch) -> None:
    """The loader without its finiteness check and Tolerance with its old one."""
    import types

    import parity.cases

    lenient = types.SimpleNamespace(**{name: getattr(math, name) for name in dir(math) if not name.startswith("_")})
    lenient.isfinite = lambda value: True
    patch.setattr(parity.cases, "math", lenient)
    patch.setattr(Tolerance, "__post_init__", _old_tolerance_check)


def _row(row_id: str) -> Bad:
    return next(row for row in BAD_INPUTS if row.id == row_id)


@pytest.mark.parametrize(
    "row_id, switch_off",
    [
        ("tolerance-atol-nan", _accept_nan),
        ("decode-steps-huge", lambda patch: patch.setattr("parity.cases._check_range", lambda *a: None)),
        ("case-name-slash", lambda patch: patch.setattr("parity.cases.SAFE_NAME", __import__("re").compile(".*"))),
        ("tolerance-nan-in-code", lambda patch: patch.setattr(Tolerance, "__post_init__", _old_tolerance_check)),
        ("moe-mask-short-eager", lambda patch: patch.setattr("serving_models.ar.model.check_gen_token_mask", lambda *a: None)),
        (
            "moe-mask-broadcast-blend",
            lambda patch: patch.setattr("serving_models.ar.model.check_gen_token_mask", lambda *a: None),
        ),
        ("ar-tensor-int", lambda patch: patch.setattr("reference_models.common.hf_checkpoint.check_floating", lambda *a: None)),
        ("review-torn-last-line", lambda patch: patch.setattr("parity.report.rows.Records.check", property(_no_problems))),
        (
            "review-interrupted-sigint",
            lambda patch: patch.setattr("parity.report.run_files.status_problem", lambda *a, **k: None),
        ),
        ("baseline-other-gpu", lambda patch: patch.setattr("parity.report.review.source_device_kind", lambda *a: None)),
        ("run-id-exists", lambda patch: patch.setattr("parity.cli.claim_run_dir", lambda *a, **k: None)),
    ],
)
def test_the_checks_are_what_catch_these(
    row_id: str, switch_off: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each named check switched off (a broken variant of the harness): the row's mistake passes
    silently, or at least no longer gives its explaining line."""
    monkeypatch.chdir(tmp_path)
    row = _row(row_id)
    if row_id == "run-id-exists":  # without the refusal the run would start: stop it at pytest
        monkeypatch.setattr("pytest.main", lambda argv: 0)
    switch_off(monkeypatch)
    outcome = row.run(tmp_path)
    explaining = [line for line in outcome.output.splitlines() if all(word in line for word in row.expect)]
    assert outcome.code == 0 or not explaining, outcome.output


# ---------------------------------------------------------------------------------------------
# The MoE mask check under eager, the CPU graph stand-in and torch.compile
# ---------------------------------------------------------------------------------------------


def _dispatch(und: torch.nn.Module, gen: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from serving_models.ar import model

    return lambda hidden, mask: model.moe_dispatch(hidden, und, gen, mask, "model.layers.1")


def _in_mode(
    mode: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`fn` run eagerly, recorded and replayed by the CPU graph stand-in, or compiled (dynamic, fullgraph)."""
    from parity.runners import make_runner
    from serving_models.common import capture

    if mode == "cpu_graph":
        runner = make_runner("cpu_graph", device="cpu", capture_registry=capture)

        def replayed(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            with runner.prepare(fn, (h, m), dummy="zeros", name="moe") as run:
                return run(h, m).output

        return replayed
    if mode == "compiled":
        torch._dynamo.reset()
        return torch.compile(fn, dynamic=True, fullgraph=True)
    return fn


MODES = ["eager", "cpu_graph", "compiled"]
GOOD_MASK = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
BAD_MASKS = {"short": GOOD_MASK[:, :4], "one-per-sequence": GOOD_MASK[:, :1]}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_the_moe_mask_check_holds_in_every_mode(mode: str) -> None:
    """A right mask runs in every mode and matches eager; a short mask or one entry per sequence
    raises in every mode (eager: the gather path; cpu_graph: the blend while recording; compiled:
    after a compile on the right shapes, Dynamo's guard on the sizes sends the bad call to a new
    trace where `torch._check` fails)."""
    und, gen = _experts()
    fn = _dispatch(und, gen)
    hidden = torch.randn(2, 5, 8)
    call = _in_mode(mode, fn)
    with torch.no_grad():
        torch.testing.assert_close(call(hidden, GOOD_MASK), fn(hidden, GOOD_MASK), atol=1e-6, rtol=1e-6)
        for mask in BAD_MASKS.values():
            shapes = rf"gen_token_mask \({mask.shape[0]}, {mask.shape[1]}\).*hidden_states \(2, 5, 8\)"
            with pytest.raises(Exception, match="one torch.bool entry per row" if mode == "compiled" else shapes):
                call(hidden, mask)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_without_the_check_a_mask_of_one_entry_per_sequence_passes_silently(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The defect the check answers, in every mode: a [B, 1] mask leaves rows of the eager path's
    `torch.empty` output unwritten, and broadcasts in the blend (captured, compiled); nothing raises."""
    from serving_models.ar import model

    monkeypatch.setattr(model, "check_gen_token_mask", lambda *a: None)
    und, gen = _experts()
    hidden = torch.randn(2, 5, 8)
    with torch.no_grad():
        out = _in_mode(mode, _dispatch(und, gen))(hidden, BAD_MASKS["one-per-sequence"])
    assert out.shape == (2, 5, 8)


# ---------------------------------------------------------------------------------------------
# run.json and Ctrl-C
# ---------------------------------------------------------------------------------------------


def test_run_json_records_the_end_of_a_session() -> None:
    from parity.plugin.session import run_status

    assert run_status(0, signal_name=None, stopped="")["status"] == "complete"
    assert run_status(1, signal_name=None, stopped="")["status"] == "complete"  # failures are a complete run
    assert run_status(2, signal_name="SIGINT", stopped="") == {"status": "interrupted", "signal": "SIGINT", "reason": None}
    assert run_status(2, signal_name="SIGTERM", stopped="")["signal"] == "SIGTERM"
    assert run_status(1, signal_name=None, stopped="stopping after 1 failures")["status"] == "interrupted"
    assert run_status(3, signal_name=None, stopped="")["status"] == "crashed"


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_ctrl_c_during_parity_run_leaves_run_json_interrupted_and_the_review_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT to a real `parity run` once its first rows are on disk: run.json says interrupted
    (SIGINT), every row written is whole, and `parity review` exits 3 saying so (the review in
    this process: it reads the run directory and writes its page, nothing process-wide)."""
    run_dir = tmp_path / "reports" / "ctrl-c"
    args = [
        sys.executable,
        "-m",
        "parity",
        "run",
        "--suite",
        "routing",
        "--report-dir",
        str(tmp_path / "reports"),
        "--run-id",
        "ctrl-c",
    ]
    child = subprocess.Popen(
        args,
        cwd=PROJECT_ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )
    try:
        results = run_dir / RESULTS_FILE
        reached = wait_for(  # no time limit: stopped only when the run stops writing (parity.observe.progress)
            lambda: results.is_file() and results.stat().st_size >= 2000,
            [tmp_path / "reports"],
            what="parity run --suite routing writing its first rows",
            alive=lambda: child.poll() is None,
        )
        assert reached, child.communicate()
        info = read_run_info(run_dir)
        assert info["status"] == "running" and info["pid"] == child.pid
        child.send_signal(signal.SIGINT)
        out, err = communicate_watched(child)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode != 0, out + err
    info = read_run_info(run_dir)
    assert (info["status"], info["signal"]) == ("interrupted", "SIGINT"), info
    assert "the run is interrupted (SIGINT)" in err
    monkeypatch.chdir(tmp_path)
    code = main(["review", str(run_dir), "--no-baseline"])
    reviewed = capsys.readouterr()
    assert code == 3, reviewed.out + reviewed.err
    assert "INCOMPLETE RUN: the run was interrupted (SIGINT)" in reviewed.out
    assert "the run is incomplete (exit 3" in reviewed.err
    assert "torn" not in reviewed.out  # every row that was written is whole
    code = main(["review", str(run_dir), "--no-baseline", "--allow-incomplete"])
    allowed = capsys.readouterr()
    assert code == 0, allowed.out + allowed.err


# ---------------------------------------------------------------------------------------------
# Said where a user reads it
# ---------------------------------------------------------------------------------------------


def test_help_and_readme_say_the_target_imports_code() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    assert "imports and runs that module's code" in " ".join(out.getvalue().split())
    readme = " ".join((PROJECT_ROOT / "README.md").read_text().split())
    assert "imports and runs the named module" in readme and "point it only at code you trust" in readme

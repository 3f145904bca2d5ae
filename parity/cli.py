"""`parity`: the command line of the harness.

`parity run` is the main job: it runs the parity suites through pytest with the plugin, shows
pytest's progress, prints a per-suite summary and the run directory, and exits non-zero when any
check failed; it also writes the run's review page (`index.html`). `parity review` reads a run
directory, prints what failed and what changed against the baseline of its device kind and dtype,
writes `index.html`, and exits non-zero on any failure or regression; `--write-baseline` regenerates
the baseline. `parity make-checkpoint` writes a random checkpoint with upstream tensor names.
`parity check-target` checks a target against the contract of docs/targets.md (`parity run` does it
first and stops with one line when the target does not conform).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from parity import env
from parity.plugin.options import add_run_options, check_run_id, check_seed, plugin_load_args, pytest_args
from parity.plugin.session import RunDirError, claim_run_dir, probe_report_dir
from parity.report import (
    COMPLETE,
    ReportError,
    format_summary,
    mutation_score,
    new_run_id,
    outcome,
    read_results,
    read_run_info,
)

SUITES_DIR = Path(__file__).resolve().parent / "suites"
DEFAULT_REPORT_DIR = Path("reports") / "runs"  # relative to the directory parity runs in
CHECKPOINT_MAKER = "reference_models.checkpoints:make_checkpoint"
PYTEST_INTERRUPTED, PYTEST_USAGE_ERROR, PYTEST_NO_TESTS = 2, 4, 5
TARGET_UNRESOLVED = 3  # `parity check-target`: the spec names no loadable factory (1: it loads and breaks the contract)


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run",
        help="run the parity suites and write a report",
        description=(
            "Run the parity suites (parity/suites/) through pytest with the parity plugin and write one run "
            "directory with results.csv. Prints a per-suite summary (cases, pass, fail, tie_flip, error, "
            "worst metric) and exits non-zero if any check failed or errored."
        ),
    )
    add_run_options(run.add_argument, prefix="")
    run.add_argument("-n", "--numprocesses", default=None, metavar="N", help="pytest-xdist workers (passed to pytest -n)")
    run.add_argument(
        "--benchmarks",
        action="store_true",
        help="also run the pytest-benchmark benchmarks (serially; results into the run directory)",
    )
    run.add_argument(
        "pytest_args",
        nargs=argparse.REMAINDER,
        help="extra arguments after `--` are passed to pytest unchanged",
    )
    run.set_defaults(func=cmd_run)


def _add_checkpoint_parser(sub: argparse._SubParsersAction) -> None:
    ckpt = sub.add_parser(
        "make-checkpoint",
        help="write a random checkpoint with upstream tensor names",
        description=(
            "Write an HF-style checkpoint directory (config.json + model.safetensors) with seeded random "
            "weights and upstream tensor names; both the reference and the serving models load it."
        ),
    )
    ckpt.add_argument("kind", choices=("ar", "dit"), help="which model: ar (MammothModa2 backbone) or dit (Transformer2DModel)")
    ckpt.add_argument("out_dir", type=Path, help="directory to write (created if missing)")
    ckpt.add_argument("--size", choices=("tiny", "full"), default="tiny", help="configuration (default: tiny)")
    ckpt.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: 0)")
    ckpt.add_argument(
        "--layout",
        choices=("parity", "release"),
        default="parity",
        help=(
            "parity: flat config.json and upstream names (default); release: the released model's layout, a nested "
            "Mammothmoda2Config and prefixed tensor names (docs/checkpoints.md), for the families registered for it"
        ),
    )
    ckpt.add_argument(
        "--max-shard-bytes", type=int, default=None, metavar="N", help="write shards of at most N bytes with an index"
    )
    ckpt.set_defaults(func=cmd_make_checkpoint)


def _add_inspect_parser(sub: argparse._SubParsersAction) -> None:
    inspect = sub.add_parser(
        "inspect-checkpoint",
        help="show a checkpoint's recognised config, ignored keys and tensor mapping per implementation",
        description=(
            "Read a checkpoint directory (parity's layout or the release's) family by family: the config fields "
            "recognised (with the key each came from or the upstream default), the keys kept but ignored (with why), "
            "and for the reference and the target the tensors matched, unused and missing. Exit 0: both load every "
            "family present; 1: a config is refused or an implementation cannot load the directory."
        ),
    )
    inspect.add_argument("directory", type=Path, metavar="DIR")
    inspect.add_argument(
        "--target", default="serving", help="the implementation inspected beside the reference (default: serving)"
    )
    inspect.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device the models load on (default: cpu)")
    inspect.set_defaults(func=cmd_inspect_checkpoint)


def _add_review_parser(sub: argparse._SubParsersAction) -> None:
    from parity.report.baseline import BASELINE_DIR, DEFAULT_MARGIN

    review = sub.add_parser(
        "review",
        help="summarise a run, compare it with its baseline, write its index.html",
        description=(
            "Read a run directory: print a per-suite summary (failing rows first, with value and threshold), "
            f"compare with the baseline of the run's device kind and dtype ({BASELINE_DIR}/"
            "<device kind>-<dtype>.csv, e.g. cpu-fp32.csv, h200-bf16.csv) or --baseline, and write RUN_DIR/index.html. "
            "A gate row is a regression when its verdict went to fail/error, its bound was loosened, or it uses "
            "more than MARGIN more of its bound than in the baseline; a vanished gate row fails too; info rows never do. "
            "A run that did not complete (run.json status interrupted, crashed, running or none; records of results.csv "
            "cut short) is said first and exits 3 unless --allow-incomplete; its whole rows are reviewed either way. "
            "Exit 0: clean; 1: a failing row, a regression or a vanished gate row; 2: unreadable run (no rows) or unusable "
            "baseline; 3: incomplete run."
        ),
    )
    review.add_argument(
        "run_dir",
        nargs="?",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="run directory with results.csv (default: the latest under reports/runs)",
    )
    which = review.add_mutually_exclusive_group()
    which.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="RUN_DIR_OR_CSV",
        help="compare with this run directory or CSV instead of the committed baseline",
    )
    which.add_argument("--no-baseline", action="store_true", help="do not compare with any baseline")
    review.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        help=f"share of a row's bound it may move toward the bound before it is a regression (default {DEFAULT_MARGIN})",
    )
    review.add_argument(
        "--write-baseline",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help=(
            "after reviewing, write this run as the baseline (default path: reports/baselines/<device kind>-<dtype>.csv "
            "for the built-in target, <device kind>-<dtype>-<target>.csv for any other); give RUN_DIR before this option"
        ),
    )
    review.add_argument(
        "--force",
        action="store_true",
        help=(
            "with --write-baseline: replace an existing baseline made for another target or configuration, "
            "or one holding cases this run lacks (refused otherwise)"
        ),
    )
    review.add_argument(
        "--all", action="store_true", dest="show_all", help="list passing gate rows too, not just failing and tie-flip ones"
    )
    review.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="review an interrupted, crashed or torn run by its rows (exit 0/1) instead of exiting 3",
    )
    review.set_defaults(func=cmd_review)


def _add_check_target_parser(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser(
        "check-target",
        help="check a target against the contract and list which suites will run or skip",
        description=(
            "Resolve the target once and check it against the contract of docs/targets.md: its members, and per "
            "model family it provides, every adapter member called once on a tiny input (return types and shapes). "
            "Lists the families and suites that will run or skip and why, and the engine policies the target "
            "declares not applicable. Exit 0: conforms; 1: a member is missing or returns the wrong thing (one line each)."
        ),
    )
    check.add_argument("target", metavar="TARGET", help="serving, reference or package.module:factory")
    check.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device of the tiny probe (default: cpu)")
    check.add_argument(
        "--suite",
        action="append",
        default=[],
        metavar="NAME",
        help="probe only the families these report suites need (repeatable; default: every family)",
    )
    check.add_argument("--quiet", action="store_true", help="print nothing when the target conforms")
    check.set_defaults(func=cmd_check_target)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parity", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    _add_review_parser(sub)
    _add_checkpoint_parser(sub)
    _add_check_target_parser(sub)
    _add_inspect_parser(sub)
    return parser


def pytest_args_for_run(args: argparse.Namespace, run_id: str) -> list[str]:
    """The pytest command line `parity run` executes (also used by tests and the CI docs)."""
    lane = "gpu" if args.device == "cuda" else "cpu"
    marker = lane if args.benchmarks else f"{lane} and not benchmark"
    values = {**vars(args), "run_id": run_id}
    argv = [
        *plugin_load_args(),
        str(SUITES_DIR),
        "-m",
        marker,
        *pytest_args(values),
        "--parity-no-summary",
        "-rfE",
        "-p",
        "no:cacheprovider",
    ]
    if args.numprocesses and not args.benchmarks:
        argv += ["-n", str(args.numprocesses)]
    extra = list(args.pytest_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    return argv + extra


def cmd_run(args: argparse.Namespace) -> int:
    """Run the suites through pytest in this process. Options pytest refuses (an unknown suite, a
    target that does not resolve, an existing run id) end it with pytest's one `ERROR:` line and
    exit status 4. The run directory and its `run.json` are made by the plugin at the first row
    (status `running`) and its end recorded there; this command writes nothing before pytest starts,
    so a refused run leaves no directory behind."""
    import pytest

    try:
        if args.run_id is not None:
            check_run_id(args.run_id)
        check_seed(args.seed)
    except ValueError as exc:
        print(f"parity run: {exc}", file=sys.stderr)
        return PYTEST_USAGE_ERROR
    run_id = args.run_id or new_run_id()
    report_dir = Path(args.report_dir) if args.report_dir else DEFAULT_REPORT_DIR
    run_dir = report_dir / run_id
    try:
        claim_run_dir(run_dir, overwrite=args.overwrite, append=args.append, prefix="")
        probe_report_dir(report_dir, "--report-dir")
    except (RunDirError, OSError) as exc:
        print(f"parity run: {exc}", file=sys.stderr)
        return PYTEST_USAGE_ERROR
    argv = pytest_args_for_run(args, run_id)
    env.select_cpu_kernels()  # before pytest imports anything that runs a kernel (docs/cpu-kernels.md)
    with ConformanceCheck.start(args) as check:
        warm_imports()  # while the check's process builds the target: both take a few seconds
        problem = check.problem()
    if problem is not None:
        print(
            f"parity run: target {args.target} does not conform (parity check-target {args.target}): {problem}", file=sys.stderr
        )
        return 1
    print(f"parity run: {run_dir}\n  pytest {' '.join(argv)}", flush=True)
    code = int(pytest.main(argv))
    if code == PYTEST_USAGE_ERROR:
        return code  # pytest printed the one ERROR line
    if code == PYTEST_NO_TESTS:
        print(f"parity run: no tests were selected (pytest exit code 5) for {' '.join(argv)}", file=sys.stderr)
        return PYTEST_NO_TESTS
    if not (run_dir / "results.csv").exists():
        print(f"parity run: no report rows were written (pytest exit code {code}); see the output above", file=sys.stderr)
        return code or 1
    info = read_run_info(run_dir)
    if info.get("status") != COMPLETE:
        how = info.get("signal") or info.get("reason") or "no end recorded"
        print(
            f"parity run: the run is {info.get('status', 'unknown')} ({how}): the summary below covers the rows written "
            f"before it stopped; run.json says so and `parity review` will too",
            file=sys.stderr,
        )
    result = outcome(run_dir)
    print("\nparity summary")
    print(format_summary(result.summary))
    print(f"\n{result.rows} rows: {run_dir / 'results.csv'}")
    score = mutation_score(read_results(run_dir))
    if score is not None:
        print(score.line())
    try:
        from parity.report.page import write_page
        from parity.report.review import load_review

        print(f"review page: {write_page(load_review(run_dir, use_default_baseline=False))}")
    except Exception as exc:  # a broken page must not hide the verdicts printed above, but must not pass
        print(f"parity run: could not write the review page: {type(exc).__name__}: {exc}", file=sys.stderr)
        return code or 1
    if not result.ok:
        print(f"parity run: {result.failed_cases} case(s) failed or errored", file=sys.stderr)
        return code or 1
    if info.get("status") != COMPLETE:
        return code or PYTEST_INTERRUPTED
    return code


def cmd_review(args: argparse.Namespace) -> int:
    from parity.report.baseline import BaselineError, default_baseline_path, write_baseline
    from parity.report.page import write_page
    from parity.report.review import (
        EXIT_FAILED,
        EXIT_INCOMPLETE,
        EXIT_OK,
        EXIT_UNUSABLE,
        format_review,
        latest_run_dir,
        load_review,
    )

    try:
        run_dir = args.run_dir or latest_run_dir(DEFAULT_REPORT_DIR)
        try:
            review = load_review(run_dir, baseline=args.baseline, use_default_baseline=not args.no_baseline, margin=args.margin)
        except BaselineError as exc:
            if args.write_baseline is None:
                raise
            # Regenerating for a new configuration: there is nothing valid to compare with yet.
            print(f"parity review: not compared with the old baseline: {exc}")
            review = load_review(run_dir, use_default_baseline=False)
    except (OSError, ReportError, BaselineError, ValueError) as exc:
        print(f"parity review: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    if review.frame.empty:
        for problem in review.incomplete:
            print(f"parity review: {problem}", file=sys.stderr)
        print(f"parity review: {run_dir / 'results.csv'}: no rows to review", file=sys.stderr)
        return EXIT_UNUSABLE
    print(format_review(review, show_all=args.show_all))
    print(f"review page: {write_page(review)}")
    if args.write_baseline is not None and not review.complete:
        print(f"parity review: refusing to write a baseline from an incomplete run ({review.incomplete[0]})", file=sys.stderr)
        return EXIT_INCOMPLETE
    if args.write_baseline is not None:
        target = Path(args.write_baseline) if args.write_baseline else default_baseline_path(run_dir, review.frame)
        try:
            written = write_baseline(review.frame, target, force=args.force)
        except BaselineError as exc:
            print(f"parity review: {exc}", file=sys.stderr)
            return EXIT_FAILED
        print(f"wrote baseline {written} ({len(review.frame)} rows): the comparison above is what it accepts")
        return EXIT_OK
    if not review.complete and not args.allow_incomplete:
        print(
            f"parity review: the run is incomplete (exit {EXIT_INCOMPLETE}; --allow-incomplete reviews its rows)", file=sys.stderr
        )
        return EXIT_INCOMPLETE
    return EXIT_OK if review.ok else EXIT_FAILED


def cmd_check_target(args: argparse.Namespace) -> int:
    from parity.conformance import check_target
    from parity.target import TargetError, resolve_target

    try:
        target = resolve_target(args.target)
    except TargetError as exc:
        print(f"parity check-target: {exc}", file=sys.stderr)
        return TARGET_UNRESOLVED
    result = check_target(target, args.target, device=args.device, suites=args.suite)
    if not result.ok:
        for problem in result.all_problems():
            print(f"parity check-target: {problem}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(result.text())
    return 0


class ConformanceCheck:
    """`parity check-target` for `parity run`'s target, in a process of its own (a target factory
    may patch modules, as the mutant catalogue's do, and must do so only in the process that runs
    the suites). Started before the run's own imports so the two overlap."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process

    @classmethod
    def start(cls, args: argparse.Namespace) -> ConformanceCheck:
        command = [sys.executable, "-m", "parity", "check-target", args.target, "--device", args.device, "--quiet"]
        for suite in args.suite:
            command += ["--suite", suite]
        return cls(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))

    def __enter__(self) -> ConformanceCheck:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process.poll() is None:  # left early (Ctrl-C during the imports): stop the check too
            self.process.kill()
            self.process.wait()

    def problem(self) -> str | None:
        """None when the target conforms, else the check's first problem line."""
        _, stderr = self.process.communicate()
        code = self.process.returncode
        if code in (0, TARGET_UNRESOLVED):
            return None  # a target that does not resolve: pytest refuses it with its one ERROR line (exit 4)
        lines = [line for line in stderr.splitlines() if line.strip()]
        problems = [line for line in lines if line.startswith("parity check-target: ")]
        return (problems or lines or [f"exit code {code}"])[0].removeprefix("parity check-target: ")


def warm_imports() -> None:
    """Import Dynamo, which every run needs (about 1.5 s on 2 cores beyond torch, which this module
    already imported), so it overlaps the conformance check. Not parity's own modules: pytest must
    import those itself to rewrite their asserts."""
    import torch._dynamo  # noqa: F401


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    module_name, _, attr = CHECKPOINT_MAKER.partition(":")
    make_checkpoint = getattr(importlib.import_module(module_name), attr)
    options = {} if args.max_shard_bytes is None else {"max_shard_bytes": args.max_shard_bytes}
    try:
        path = make_checkpoint(args.kind, args.size, args.seed, args.out_dir, layout=args.layout, **options)
    except ValueError as exc:
        print(f"parity make-checkpoint: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.kind} checkpoint ({args.size}, seed {args.seed}, {args.layout} layout) to {path}")
    return 0


def cmd_inspect_checkpoint(args: argparse.Namespace) -> int:
    from parity.checkpoint_inspect import inspect_checkpoint

    try:
        result = inspect_checkpoint(args.directory, args.target, args.device)
    except (OSError, ValueError) as exc:
        print(f"parity inspect-checkpoint: {exc}", file=sys.stderr)
        return 1
    print(result.text())
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

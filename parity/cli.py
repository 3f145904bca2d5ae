"""`parity`: the command line of the harness.

`parity run` is the main job: it runs the parity suites through pytest with the plugin, shows
pytest's progress, prints a per-suite summary and the run directory, and exits non-zero when any
check failed; it also writes the run's review page (`index.html`). `parity review` reads a run
directory, prints what failed and what changed against the baseline of its device kind and dtype,
writes `index.html`, and exits non-zero on any failure or regression; `--write-baseline` regenerates
the baseline. `parity make-checkpoint` writes a random checkpoint with upstream tensor names.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from parity import env
from parity.plugin.options import add_run_options, plugin_load_args, pytest_args
from parity.report import ReportError, format_summary, mutation_score, new_run_id, outcome, read_results

SUITES_DIR = Path(__file__).resolve().parent / "suites"
DEFAULT_REPORT_DIR = Path("reports") / "runs"  # relative to the directory parity runs in
CHECKPOINT_MAKER = "reference_models.checkpoints:make_checkpoint"
PYTEST_NO_TESTS = 5


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
    ckpt.set_defaults(func=cmd_make_checkpoint)


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
            "Exit 0: clean; 1: a failing row, a regression or a vanished gate row; 2: unreadable run or unusable baseline."
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
            "after reviewing, write this run as the baseline (default path: the committed baseline of its device kind "
            "and dtype); give RUN_DIR before this option"
        ),
    )
    review.add_argument(
        "--all", action="store_true", dest="show_all", help="list passing gate rows too, not just failing and tie-flip ones"
    )
    review.set_defaults(func=cmd_review)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parity", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    _add_review_parser(sub)
    _add_checkpoint_parser(sub)
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
    import pytest

    run_id = args.run_id or new_run_id()
    report_dir = Path(args.report_dir) if args.report_dir else DEFAULT_REPORT_DIR
    run_dir = report_dir / run_id
    argv = pytest_args_for_run(args, run_id)
    env.select_cpu_kernels()  # before pytest imports anything that runs a kernel (docs/cpu-kernels.md)
    print(f"parity run: {run_dir}\n  pytest {' '.join(argv)}", flush=True)
    code = int(pytest.main(argv))
    if code == PYTEST_NO_TESTS:
        print(f"parity run: no tests were selected (pytest exit code 5) for {' '.join(argv)}", file=sys.stderr)
        return PYTEST_NO_TESTS
    if not (run_dir / "results.csv").exists():
        print(f"parity run: no report rows were written (pytest exit code {code}); see the output above", file=sys.stderr)
        return code or 1
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
    return code


def cmd_review(args: argparse.Namespace) -> int:
    from parity.report.baseline import BaselineError, default_baseline_path, write_baseline
    from parity.report.page import write_page
    from parity.report.review import EXIT_FAILED, EXIT_OK, EXIT_UNUSABLE, format_review, latest_run_dir, load_review

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
    except (FileNotFoundError, ReportError, BaselineError, ValueError) as exc:
        print(f"parity review: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    print(format_review(review, show_all=args.show_all))
    print(f"review page: {write_page(review)}")
    if args.write_baseline is not None:
        target = Path(args.write_baseline) if args.write_baseline else default_baseline_path(run_dir, review.frame)
        try:
            written = write_baseline(review.frame, target)
        except BaselineError as exc:
            print(f"parity review: {exc}", file=sys.stderr)
            return EXIT_FAILED
        print(f"wrote baseline {written} ({len(review.frame)} rows): the comparison above is what it accepts")
        return EXIT_OK
    return EXIT_OK if review.ok else EXIT_FAILED


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    module_name, _, attr = CHECKPOINT_MAKER.partition(":")
    make_checkpoint = getattr(importlib.import_module(module_name), attr)
    path = make_checkpoint(args.kind, args.size, args.seed, args.out_dir)
    print(f"wrote {args.kind} checkpoint ({args.size}, seed {args.seed}) to {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

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
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from parity import import_check  # noqa: F401 - first: a shadowed `parity` is one line, not an ImportError deep in the harness

# isort: split
from parity import env
from parity.conformance import KNOWN_SUITES, UNRESOLVED, CheckProcess, check_timeout, start_check, unknown_suites
from parity.plugin.lanes import LANES
from parity.plugin.options import (
    add_run_options,
    check_run_id,
    check_seed,
    directory_name,
    options_set_behind_parity_run,
    plugin_load_args,
    pytest_args,
    seed_option,
    workers,
)
from parity.plugin.ranks import launched_rank
from parity.plugin.session import RunDirError, SignalWatch, claim_run_dir, probe_report_dir
from parity.plugin.shards import parse_shard
from parity.report import COMPLETE, ReportError, format_summary, mutation_score, new_run_id, outcome
from parity.report.case_lines import failing_cases_text
from parity.report.run_files import RunFiles
from parity.report.run_info import target_name
from parity.target import FAMILIES

SUITES_DIR = Path(__file__).resolve().parent / "suites"
DEFAULT_REPORT_DIR = Path("reports") / "runs"  # relative to the directory parity runs in
PYTEST_INTERRUPTED, PYTEST_USAGE_ERROR, PYTEST_NO_TESTS = 2, 4, 5
MERGE_REFUSED = 2  # `parity merge`: the shards are not the parts of one run (one line each)
TARGET_UNRESOLVED = 3  # `parity check-target`: the spec names no loadable factory (1: it loads and breaks the contract)


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: after parsing, its `validators` check what one option cannot check
    alone (combinations, the run an option names); every mistake, argparse's own included, is one
    line `parity <command>: <what is wrong>` and the command's documented usage status
    (`usage_status`: 4 for `parity run`, as pytest's usage errors; 2, argparse's, elsewhere)."""

    def __init__(self, *args: object, usage_status: int = 2, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.usage_status = usage_status
        self.validators: list[Callable[[argparse.Namespace], str | None]] = []

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for validate in self.validators:
            problem = validate(namespace)
            if problem:
                self.error(problem)
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        self.exit(self.usage_status, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _run_options_problem(args: argparse.Namespace) -> str | None:
    """`parity run`'s options that are each valid but say nothing together, or name a run that is not there."""
    try:
        if args.run_id is not None:
            check_run_id(args.run_id)
        check_seed(args.seed)
    except ValueError as exc:
        return str(exc)
    if args.overwrite and args.run_id is None:
        return "--overwrite needs --run-id: it replaces the run of that id (a run without --run-id gets a new id)"
    if args.append and args.run_id is None:
        return "--append needs --run-id: the run to add this session's rows to"
    if args.append and not args.overwrite:
        run_dir = Path(args.report_dir or DEFAULT_REPORT_DIR) / args.run_id
        if not (run_dir / "run.json").is_file() and not (run_dir / "results.csv").is_file():
            return (
                f"--append --run-id {args.run_id!r}: no run of that id under {run_dir.parent} (nothing to add to); "
                "leave --append out to start it"
            )
        differ = _append_mismatch(args, run_dir)
        if differ:
            return (
                f"--append --run-id {args.run_id!r}: the existing run was made with another configuration ({'; '.join(differ)}): "
                "rows of both would not be one run; choose another run id"
            )
    if args.shard is not None:
        try:
            parse_shard(args.shard)
        except ValueError as exc:
            return str(exc)
    if args.tp < 1:
        return f"--tp {args.tp}: the tensor-parallel size must be at least 1"
    if args.tp > 1 and args.numprocesses:
        return f"--tp {args.tp} with -n {args.numprocesses}: every rank runs the same tests in the same order, so leave -n out"
    if args.tp > 1 and args.append:
        return f"--tp {args.tp} with --append: a tensor-parallel run is written whole"
    extra = list(args.pytest_args)
    behind = options_set_behind_parity_run(extra[1:] if extra[:1] == ["--"] else extra)
    if behind:
        return f"pytest arguments after -- set parity's own options: {', '.join(behind)}"
    return None


def _append_mismatch(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """How `parity run --append` differs from the run it names, before anything runs: the options,
    the torch and the tree (the target's code is compared by the session, once it has found it)."""
    from parity.plugin.options import DEFAULT_DTYPE
    from parity.plugin.session import append_mismatch
    from parity.report import read_run_info
    from parity.report.quick import quick_size

    try:
        info = read_run_info(run_dir)
    except ValueError:
        return []  # an unreadable run.json: the session refuses it with its own line
    size = quick_size(args.size) if args.quick else args.size  # the size a quick run's rows carry
    mine = {"device": args.device, "size": size, "dtype": args.dtype or DEFAULT_DTYPE[args.device], "target": args.target}
    mine.update(seed=args.seed, torch=env.torch_version(), git_sha=env.git_sha())
    return append_mismatch(info, mine)


def _review_options_problem(args: argparse.Namespace) -> str | None:
    if args.force and args.write_baseline is None:
        return "--force applies only with --write-baseline (it lets a baseline replace one made for another configuration)"
    return None


def _margin(value: str) -> float:
    """`--margin`: a finite, non-negative share of a row's bound (inf or NaN would accept any drift)."""
    try:
        margin = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {value!r}") from None
    if not 0 <= margin < math.inf:
        raise argparse.ArgumentTypeError(
            f"margin must be a non-negative fraction of the bound, got {margin} (a finite number such as 0.1)"
        )
    return margin


def _directory(value: str) -> Path:
    return Path(directory_name(value))  # '' would be the working directory, which nobody typed


def _shard_bytes(value: str) -> int:
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of bytes, got {size}")
    return size


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run",
        usage_status=PYTEST_USAGE_ERROR,
        help="run the parity suites and write a report",
        description=(
            "Run the parity suites (parity/suites/) through pytest with the parity plugin and write one run "
            "directory with results.csv. Prints a per-suite summary (cases, pass, fail, tie_flip, error, "
            "worst metric) and exits non-zero if any check failed or errored."
        ),
    )
    add_run_options(run.add_argument, prefix="")
    run.add_argument(
        "-n",
        "--numprocesses",
        default=None,
        type=workers,
        metavar="N",
        help="pytest-xdist workers: a number, auto or logical (passed to pytest -n)",
    )
    run.add_argument(
        "--benchmarks",
        action="store_true",
        help="also run the pytest-benchmark benchmarks (serially; results into the run directory)",
    )
    run.add_argument(
        "pytest_args",
        nargs=argparse.REMAINDER,
        help="extra arguments after `--` are passed to pytest unchanged (not parity's own --parity-* options)",
    )
    run.validators.append(_run_options_problem)
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
    kinds = tuple(key for key, family in FAMILIES.items() if family.loader)  # the families read from a checkpoint
    ckpt.add_argument("kind", choices=kinds, help=f"which model family: {', '.join(kinds)}")
    ckpt.add_argument("out_dir", type=_directory, help="directory to write (created if missing)")
    ckpt.add_argument("--size", choices=("tiny", "full"), default="tiny", help="configuration (default: tiny)")
    ckpt.add_argument("--seed", type=seed_option, default=0, help="random seed of the weights, 0 .. 2147483647 (default: 0)")
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
        "--max-shard-bytes",
        type=_shard_bytes,
        default=None,
        metavar="N",
        help="write shards of at most N bytes with an index (weight files of an earlier checkpoint in DIR are replaced)",
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
    inspect.add_argument("directory", type=_directory, metavar="DIR")
    inspect.add_argument(
        "--target", default="serving", help="the implementation inspected beside the reference (default: serving)"
    )
    inspect.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device the models load on (default: cpu)")
    inspect.set_defaults(func=cmd_inspect_checkpoint)


def _add_review_parser(sub: argparse._SubParsersAction) -> None:
    from parity.report.baseline import BASELINE_DIR
    from parity.report.comparison import DEFAULT_MARGIN

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
            "Nothing in results.csv is taken on trust: every gate verdict is derived again from its value, threshold and "
            "direction, and a row whose recorded verdict disagrees fails the review; rows that are not one run's parity rows "
            "(an unknown verdict, kind, better or bound, a value that is not a number, the header twice, several targets, "
            "devices, dtypes, sizes or torch versions, run.json saying otherwise) are refused. "
            "Exit 0: clean; 1: a failing row, a regression, a vanished gate row or a verdict the row's numbers contradict; "
            "2: unreadable run (no rows, not one run's parity rows, a symbolic link) or unusable baseline or --write-baseline "
            "path; 3: incomplete run."
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
        type=_margin,
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
            "for the built-in target, <device kind>-<dtype>-<target>.csv for any other); give RUN_DIR before this option. "
            "Written whole (a temporary file renamed over PATH); never into a run directory, through a symbolic link or over "
            "a file that is not a baseline (a results.csv included), --force or not"
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
    review.validators.append(_review_options_problem)
    review.set_defaults(func=cmd_review)


def _add_check_target_parser(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser(
        "check-target",
        help="check a target against the contract and list which suites will run or skip",
        description=(
            "Resolve the target once and check it against the contract of docs/targets.md: its members, and per "
            "model family it provides, every adapter member the suites call, called once on a tiny input (return types "
            "and shapes). Runs in a child process under a time limit: a target that ends the process (sys.exit, os._exit), "
            "hangs or leaves non-daemon threads running is named with the step it was at. Lists the families and suites "
            "that will run or skip and why, and the engine policies the target declares not applicable. Exit 0: conforms; "
            "1: a member is missing or returns the wrong thing, or the target exits, hangs or leaves threads (one line "
            "each); 2: an unknown --suite; 3: the spec does not resolve to a factory."
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
    check.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long the check may take before the target is named as hanging (default: $PARITY_CHECK_TARGET_TIMEOUT or 180)",
    )
    check.set_defaults(func=cmd_check_target)


def _add_merge_parser(sub: argparse._SubParsersAction) -> None:
    merge = sub.add_parser(
        "merge",
        help="make one run of the shards of a sharded lane (--shard K/N)",
        description=(
            "Join the run directories of a lane run in N shards (--shard 1/N .. N/N, one per machine) into one run "
            "directory that parity review reads like any run: the shards' rows under one run id, each row's worker "
            "naming its shard, and run.json with each shard's provenance (merged_from). Refused, one line each, before "
            "anything is written: a directory that is not a whole shard run, shards of different trees, targets, torch "
            "versions, seeds, configurations or selections, a shard given twice, a missing part, rows of one test in "
            "two shards. Exit 0: merged; 2: refused."
        ),
    )
    merge.add_argument("run_dirs", nargs="+", type=_directory, metavar="RUN_DIR", help="the shards' run directories")
    merge.add_argument("--into", required=True, type=_directory, metavar="RUN", help="the merged run directory (new)")
    merge.set_defaults(func=cmd_merge)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parity", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    _add_run_parser(sub)
    _add_review_parser(sub)
    _add_checkpoint_parser(sub)
    _add_check_target_parser(sub)
    _add_inspect_parser(sub)
    _add_merge_parser(sub)
    return parser


def pytest_args_for_run(args: argparse.Namespace, run_id: str) -> list[str]:
    """The pytest command line `parity run` executes (also used by tests and the CI docs)."""
    lane = LANES[args.device]
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
    try:
        timeout = check_timeout()
    except ValueError as exc:
        print(f"parity run: {exc}", file=sys.stderr)
        return PYTEST_USAGE_ERROR
    argv = pytest_args_for_run(args, run_id)
    env.select_cpu_kernels()  # before pytest imports anything that runs a kernel (docs/cpu-kernels.md)
    launched = launched_rank()
    if launched is not None and launched.rank != 0:
        # a peer rank under torchrun: rank 0 writes the run and says how it went (docs/lanes.md §5)
        return int(pytest.main(argv))
    # SIGINT, SIGTERM and SIGHUP end the whole command as one clean stop (docs/cli.md §1): the
    # plugin records the signal in run.json and this command still prints the summary.
    watch = SignalWatch("parity run").install()
    stage = "before any suite ran: nothing was written"
    try:
        if args.tp > 1:  # the check builds one process's target; each rank's session checks its own as it loads
            warm_imports()
            problem = None
        else:
            with ConformanceCheck.start(args, timeout) as check:
                warm_imports()  # while the check's process builds the target: both take a few seconds
                problem = check.problem()
        if problem is not None:
            print(
                f"parity run: target {args.target} does not conform (parity check-target {args.target}): {problem}",
                file=sys.stderr,
            )
            return 1
        print(f"parity run: {run_dir}\n  pytest {' '.join(argv)}", flush=True)
        code = int(pytest.main(argv))
        stage = f"after the run's end was recorded: `parity review {run_dir}` prints its summary"
        return _after_pytest(args, run_dir, argv, code)
    except KeyboardInterrupt:
        print(f"\nparity run: {watch.received or 'KeyboardInterrupt'}: stopped {stage}", file=sys.stderr)
        return PYTEST_INTERRUPTED
    finally:
        watch.restore()


def _after_pytest(args: argparse.Namespace, run_dir: Path, argv: list[str], code: int) -> int:
    """What `parity run` says once pytest has returned: the run's status in one line when it did
    not complete, the per-suite summary, the mutation score and the review page; the exit status."""
    if code == PYTEST_USAGE_ERROR:
        return code  # pytest printed the one ERROR line
    resumed_all = code == PYTEST_NO_TESTS and args.append and (run_dir / "results.csv").exists()
    if resumed_all:  # `parity.plugin.resume`: every selected test already holds its rows
        print(f"parity run: every selected test of {run_dir} already holds its rows: nothing ran again")
        code = 0
    elif code == PYTEST_NO_TESTS:
        print(f"parity run: no tests were selected (pytest exit code 5) for {' '.join(argv)}", file=sys.stderr)
        return PYTEST_NO_TESTS
    if not (run_dir / "results.csv").exists():
        print(f"parity run: no report rows were written (pytest exit code {code}); see the output above", file=sys.stderr)
        return code or 1
    run = RunFiles.read(run_dir)  # read once: the summary, the scores and the review page share it
    info = run.info
    if info.get("status") != COMPLETE:
        how = info.get("signal") or info.get("reason") or "no end recorded"
        covers = (
            "the summary below leaves those rows out"
            if info.get("unwritten_rows") and not info.get("signal")
            else "the summary below covers the rows written before it stopped"
        )
        print(
            f"parity run: the run is {info.get('status', 'unknown')} ({how}): {covers}; run.json says so and "
            "`parity review` will too",
            file=sys.stderr,
        )
    result, rows = outcome(run), run.frame
    print("\nparity summary")
    print(format_summary(result.summary, rows))
    failing = failing_cases_text(rows, run_dir)  # one line per failing case, each rule once
    if failing:
        print(failing)
    print(f"\n{result.rows} rows: {run_dir / 'results.csv'}")
    score = mutation_score(rows)
    if score is not None:
        print(score.line())
    planted = mutation_score(rows, planted_on=target_name(info))
    if planted is not None:
        print(planted.line())
    try:
        from parity.report.page import write_page
        from parity.report.review import load_review

        print(f"review page: {write_page(load_review(run, use_default_baseline=False))}")
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
    """Review a run. Exit status (docs/cli.md §5; docs/reports.md §1): 2 when the input cannot be
    used (an unreadable or symlinked run, rows that are not one run's parity rows, a baseline that
    is not whole and sound, a `--write-baseline` path that may not be written, a review/ directory
    parity did not write), 3 for an incomplete run, 1 for a failing row, a regression, a vanished
    gate row or a row whose verdict its numbers contradict, else 0."""
    from parity.report.audit import shown_lines
    from parity.report.baseline import BaselineError, check_baseline_target, default_baseline_path, write_baseline
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
    from parity.target import suite_families

    try:
        if args.write_baseline:  # refused before anything is read or written (docs/reports.md §2)
            check_baseline_target(args.write_baseline)
        run_dir = args.run_dir or latest_run_dir(DEFAULT_REPORT_DIR)
        run = RunFiles.read(run_dir)  # read once: the audit, the comparison, the text and the page share it
        try:
            review = load_review(
                run,
                baseline=args.baseline,
                use_default_baseline=not args.no_baseline,
                margin=args.margin,
                suite_families=suite_families(),
            )
        except BaselineError as exc:
            if args.write_baseline is None:
                raise
            # Regenerating for a new configuration: there is nothing valid to compare with yet.
            print(f"parity review: not compared with the old baseline: {exc}")
            review = load_review(run, use_default_baseline=False)
    except (OSError, ReportError, BaselineError, ValueError) as exc:
        print(f"parity review: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    if review.frame.empty:
        for problem in review.incomplete:
            print(f"parity review: {problem}", file=sys.stderr)
        print(f"parity review: {run_dir / 'results.csv'}: no rows to review", file=sys.stderr)
        return EXIT_UNUSABLE
    if review.unusable:
        for line in shown_lines(review.unusable):
            print(f"parity review: {line}", file=sys.stderr)
        print(
            f"parity review: {run_dir}: not reviewed, its rows are not one run's parity rows ({len(review.unusable)} "
            f"problem(s) above; exit {EXIT_UNUSABLE})",
            file=sys.stderr,
        )
        return EXIT_UNUSABLE
    print(format_review(review, show_all=args.show_all))
    try:
        print(f"review page: {write_page(review)}")
    except (OSError, ValueError) as exc:
        print(f"parity review: the review page was not written: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    if args.write_baseline is not None and not review.complete:
        print(f"parity review: refusing to write a baseline from an incomplete run ({review.incomplete[0]})", file=sys.stderr)
        return EXIT_INCOMPLETE
    if args.write_baseline is not None:
        if review.disagreements:
            first = review.disagreements[0].line()
            print(f"parity review: refusing to write a baseline from rows the audit contradicts ({first})", file=sys.stderr)
            return EXIT_FAILED
        target = (
            Path(args.write_baseline) if args.write_baseline else default_baseline_path(run_dir, review.frame, info=review.info)
        )
        try:
            written = write_baseline(review.frame, target, force=args.force)
        except (BaselineError, ValueError, OSError) as exc:
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


def cmd_merge(args: argparse.Namespace) -> int:
    """Merge the shards (`parity.report.merge`): exit 0 merged, 2 refused with one line per problem."""
    from parity.report.merge import MergeError, merge_runs

    try:
        info = merge_runs(args.run_dirs, args.into)
    except MergeError as exc:
        for line in exc.lines:
            print(f"parity merge: {line}", file=sys.stderr)
        return MERGE_REFUSED
    except (OSError, ReportError, ValueError) as exc:
        print(f"parity merge: {exc}", file=sys.stderr)
        return MERGE_REFUSED
    shards = info["merged_from"]
    rows = sum(shard["rows"] for shard in shards)
    print(f"merged {len(shards)} shards ({rows} rows, {info['selection']['selection_tests']} tests) into {args.into}")
    print(f"review it: parity review {args.into}")
    return 0


def cmd_check_target(args: argparse.Namespace) -> int:
    """Check the target in a child process (`parity.conformance.start_check`): whatever the target
    does (exit, hang, leave threads), this command ends within the time limit with one line each."""
    unknown = unknown_suites(args.suite)
    if unknown:
        print(
            f"parity check-target: --suite {', '.join(map(repr, unknown))}: no such suite; suites: {', '.join(KNOWN_SUITES)}",
            file=sys.stderr,
        )
        return PYTEST_INTERRUPTED  # 2, argparse's usage status
    try:
        timeout = check_timeout(args.timeout)
    except ValueError as exc:
        print(f"parity check-target: {exc}", file=sys.stderr)
        return PYTEST_INTERRUPTED
    outcome = start_check(args.target, args.device, args.suite).wait(timeout)
    if outcome.code == UNRESOLVED:
        print(f"parity check-target: {outcome.lines[0]}", file=sys.stderr)
        return TARGET_UNRESOLVED
    if outcome.code != 0:
        for problem in outcome.lines:
            print(f"parity check-target: {problem}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(outcome.text)
    return 0


class ConformanceCheck:
    """`parity check-target` for `parity run`'s target, in a fresh process of its own (a target
    factory may patch modules, as the mutant catalogue's do, and must do so only in the process
    that runs the suites) under the same time limit. Started before the run's own imports so the
    two overlap."""

    def __init__(self, process: CheckProcess, timeout: float) -> None:
        self.process = process
        self.timeout = timeout

    @classmethod
    def start(cls, args: argparse.Namespace, timeout: float) -> ConformanceCheck:
        return cls(start_check(args.target, args.device, args.suite, fresh=True, quiet=True), timeout)

    def __enter__(self) -> ConformanceCheck:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.process.stop()  # left early (Ctrl-C during the imports): stop the check too

    def problem(self) -> str | None:
        """None when the target conforms, else the check's first problem line."""
        outcome = self.process.wait(self.timeout)
        if outcome.code in (0, UNRESOLVED):
            return None  # a target that does not resolve: pytest refuses it with its one ERROR line (exit 4)
        return (outcome.lines or [f"the check ended with code {outcome.code}"])[0]


def warm_imports() -> None:
    """Import Dynamo, which every run needs (about 1.5 s on 2 cores beyond torch, which this module
    already imported), so it overlaps the conformance check. Not parity's own modules: pytest must
    import those itself to rewrite their asserts."""
    import torch._dynamo  # noqa: F401


def _weight_files(directory: Path) -> set[str]:
    if not directory.is_dir():
        return set()
    return {p.name for pattern in ("*.safetensors", "*.safetensors.index.json") for p in directory.glob(pattern)}


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    """Write the checkpoint; a directory that held one gets exactly the new weight files (the old
    ones the new checkpoint does not overwrite are removed, and said)."""
    from parity.tools import make_checkpoint

    options = {} if args.max_shard_bytes is None else {"max_shard_bytes": args.max_shard_bytes}
    before = _weight_files(args.out_dir)
    try:
        path = make_checkpoint.write_checkpoint(args.kind, args.size, args.seed, args.out_dir, layout=args.layout, **options)
    except (ValueError, OSError) as exc:
        print(f"parity make-checkpoint: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.kind} checkpoint ({args.size}, seed {args.seed}, {args.layout} layout) to {path}")
    removed = sorted(before - _weight_files(Path(path)))
    if removed:
        print(f"removed the earlier checkpoint's weight files the new one does not have: {', '.join(removed)}")
    return 0


def cmd_inspect_checkpoint(args: argparse.Namespace) -> int:
    from parity.tools.inspect_checkpoint import inspect_checkpoint

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

"""Recording and reviewing a run: rows (`rows`), baselines (`baseline`), the text review (`review`)
and the HTML page (`page`, `plots`).

The row API is re-exported here because suites and the plugin write rows through it.
"""

from parity.report.rows import (
    BETTER,
    CASE_KEYS,
    COLUMNS,
    CONTEXT_COLUMNS,
    KINDS,
    RESULTS_FILE,
    RUN_INFO_FILE,
    SUMMARY_COLUMNS,
    MutationScore,
    ReportError,
    ReportWriter,
    RunOutcome,
    add_suite_seconds,
    case_verdicts,
    format_summary,
    make_run_dir,
    mutation_score,
    new_run_id,
    outcome,
    read_results,
    read_run_info,
    summarize,
    write_run_info,
)

__all__ = [
    "BETTER",
    "CASE_KEYS",
    "COLUMNS",
    "CONTEXT_COLUMNS",
    "KINDS",
    "RESULTS_FILE",
    "RUN_INFO_FILE",
    "SUMMARY_COLUMNS",
    "MutationScore",
    "ReportError",
    "ReportWriter",
    "RunOutcome",
    "case_verdicts",
    "format_summary",
    "make_run_dir",
    "mutation_score",
    "new_run_id",
    "outcome",
    "read_results",
    "add_suite_seconds",
    "read_run_info",
    "summarize",
    "write_run_info",
]

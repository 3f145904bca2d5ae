"""Recording and reviewing a run. By job, leaves first: the files' shape (`schema`), run.json
(`run_info`), writing and reading rows (`rows`), a run read once (`run_files`), the summary and the
mutation score (`summary`, `mutation`), the audit (`audit`), baselines and the comparison with one
(`baseline`, `comparison`), the text review (`review`) and the HTML page (`html` helpers, `sections`
and `views` as data, `page` rendering the templates, `plots`).

The row API is re-exported here because suites and the plugin write rows through it.
"""

from parity.report.mutation import MutationScore, mutation_score
from parity.report.rows import ReportWriter, ResultsCheck, check_results, read_results
from parity.report.run_info import (
    add_suite_seconds,
    make_run_dir,
    new_run_id,
    now_text,
    read_run_info,
    update_run_info,
    write_run_info,
)
from parity.report.schema import (
    BETTER,
    CASE_KEYS,
    COLUMNS,
    COMPLETE,
    CONTEXT_COLUMNS,
    CRASHED,
    INTERRUPTED,
    KINDS,
    NOT_PROVIDED,
    RESULTS_FILE,
    RUN_INFO_FILE,
    RUN_STATUSES,
    RUNNING,
    ReportError,
)
from parity.report.summary import (
    SUMMARY_COLUMNS,
    RunOutcome,
    case_verdicts,
    format_summary,
    not_provided_lines,
    outcome,
    summarize,
)

__all__ = [
    "COMPLETE",
    "CRASHED",
    "INTERRUPTED",
    "RUN_STATUSES",
    "RUNNING",
    "ResultsCheck",
    "check_results",
    "now_text",
    "update_run_info",
    "BETTER",
    "CASE_KEYS",
    "COLUMNS",
    "CONTEXT_COLUMNS",
    "KINDS",
    "NOT_PROVIDED",
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
    "not_provided_lines",
    "outcome",
    "read_results",
    "add_suite_seconds",
    "read_run_info",
    "summarize",
    "write_run_info",
]

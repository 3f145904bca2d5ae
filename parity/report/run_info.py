"""`run.json`: a run's id, environment and status, written whole at every change (docs/cli.md §1).

Written with the first row (`running`), updated by the session as it goes (`suite_seconds`) and at
its end (`complete`, `interrupted`, `crashed`, `incomplete`: `parity.report.schema`); read by the
review, which takes it as the run's own account and checks it against the rows (docs/reports.md §1).
"""

from __future__ import annotations

import datetime as _dt
import json
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from parity.report.rundir import atomic_write, refuse_link
from parity.report.schema import RUN_INFO_FILE, ReportError


def new_run_id() -> str:
    """A sortable, collision-safe run id: UTC timestamp plus 6 random hex digits."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def make_run_dir(report_dir: str | Path, run_id: str | None = None) -> Path:
    """Create `report_dir/run_id/` (a fresh id if none is given) and return it."""
    run_dir = Path(report_dir) / (run_id or new_run_id())
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def now_text() -> str:
    """The current UTC time as run.json and the rows write it."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


def write_run_info(run_dir: Path, info: Mapping[str, Any]) -> None:
    """Write `run.json` whole or not at all (a temporary file renamed over it): a crash while it is
    written leaves the previous version, never half a file."""
    refuse_link(Path(run_dir), "the run directory")
    atomic_write(Path(run_dir) / RUN_INFO_FILE, json.dumps(dict(info), indent=2, sort_keys=True, default=str) + "\n")


def add_suite_seconds(run_dir: Path, seconds: Mapping[str, float]) -> None:
    """Record in run.json the seconds each report suite's tests took (`suite_seconds`)."""
    info = read_run_info(run_dir)
    info["suite_seconds"] = {suite: round(value, 3) for suite, value in sorted(seconds.items())}
    write_run_info(run_dir, info)


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """`run.json` of a run directory ({} when there is none); an unreadable one is a ReportError."""
    path = Path(run_dir) / RUN_INFO_FILE
    if not path.exists():
        return {}
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(info, dict):
        raise ReportError(f"{path}: expected a JSON object, found {type(info).__name__}")
    return info


def update_run_info(run_dir: Path, **changes: Any) -> dict[str, Any]:
    """Change some keys of `run.json` (None removes a key) and write it back whole."""
    info = read_run_info(run_dir)
    for key, value in changes.items():
        if value is None:
            info.pop(key, None)
        else:
            info[key] = value
    write_run_info(run_dir, info)
    return info


def target_name(info: Mapping[str, Any]) -> str:
    """The name the run's target declares (its `name` attribute, in run.json's `target_provenance`);
    '' for a run recorded before parity kept it, or whose target could not be resolved."""
    provenance = info.get("target_provenance")
    name = provenance.get("name") if isinstance(provenance, dict) else None
    return name if isinstance(name, str) else ""

"""loadgen's exit status: a run whose requests failed is no result to publish, and a script running a benchmark
must see that without reading the JSON (47 of 60 requests UNAVAILABLE, the server dead mid-run, exited 0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadgen.record import REJECTED

EXIT_OK = 0  # every run completed requests, and failed none but those admission shed
EXIT_FAILED = 1  # the cluster could not be reached or went away, or a run failed as failed_runs says
EXIT_USAGE = 2  # bad flags, a bad trace, or a check request the server refused as invalid
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), as a shell reports a command it interrupted: 128 + 2


def failed_runs(runs: list[dict[str, Any]]) -> list[str]:
    """One line per run that completed no request, or failed requests other than sheds (RESOURCE_EXHAUSTED is
    admission turning load away, an answer the benchmark measures, not a failure of the run)."""
    lines = []
    for run in runs:
        failures = {code: n for code, n in run["failed_by_code"].items() if code != REJECTED}
        label = f"the run at request_rate {run['request_rate']}"
        if not run["completed"]:
            lines.append(f"{label} completed no request ({_counts(run['failed_by_code'])})")
        elif failures:
            lines.append(f"{label} failed {sum(failures.values())} requests ({_counts(failures)})")
    return lines


def _counts(by_code: dict[str, int]) -> str:
    return ", ".join(f"{code}: {n}" for code, n in by_code.items()) or "none sent"


def interrupted_line(runs: list[dict[str, Any]], result_json: Path | None) -> str:
    """The one line Ctrl-C prints: where it cut the benchmark, and what of it was kept where."""
    if not runs:
        return "interrupted before the first rate: nothing measured"
    cut = runs[-1] if runs[-1]["interrupted"] else None
    finished = len(runs) - (cut is not None)
    where = "between rates"
    if cut is not None:
        sent = len(cut["requests"])
        where = f"during the run at request_rate {cut['request_rate']} ({sent} sent, those in flight cancelled)"
    kept = f"{finished} finished rate(s)" + (" and the interrupted one, marked interrupted: true," if cut else "")
    return f"interrupted {where}: {kept} {f'in {result_json}' if result_json else 'not written (no --result-json)'}"

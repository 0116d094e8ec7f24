"""loadgen's exit status: a run whose requests failed is no result to publish, and a script running a benchmark
must see that without reading the JSON (47 of 60 requests UNAVAILABLE, the server dead mid-run, exited 0)."""

from __future__ import annotations

from typing import Any

from loadgen.record import REJECTED

EXIT_OK = 0  # every run completed requests, and failed none but those admission shed
EXIT_FAILED = 1  # the cluster could not be reached or went away, or a run failed as failed_runs says
EXIT_USAGE = 2  # bad flags, a bad trace, or a check request the server refused as invalid


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

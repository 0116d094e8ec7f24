"""The chaos run's report: what the clients got, what the workers still hold, how fast the cluster healed."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table

from pdserve.chaos.faults import Fault
from pdserve.chaos.load import Outcome


def summarize(
    outcomes: list[Outcome], reference: list[list[int]], faults: list[Fault], blocks: dict[str, int], in_flight: int
) -> dict[str, Any]:
    """A failed request has a status; a completed one got its final message; a lost one neither. `in_flight`: the
    router's count once idle (a request it still counts leaked its ticket)."""
    failed = [o for o in outcomes if o.status]
    completed = [o for o in outcomes if o.finished and not o.status]
    lost = [o for o in outcomes if not o.finished and not o.status]
    wrong = [o for o in completed if o.tokens != reference[o.prompt]]
    return {
        "requests": len(outcomes),
        "completed": len(completed),
        "completed_right_output": len(completed) - len(wrong),
        "completed_wrong_output": len(wrong),
        "failed": len(failed),
        "failed_by_status": dict(Counter(o.status for o in failed)),
        "lost": len(lost),
        "kv_blocks_held_after_idle": sum(blocks.values()),
        "kv_blocks_held_by_worker": blocks,
        "router_in_flight_after_idle": in_flight,
        "kills": sum(f.kind == "kill" for f in faults),
        "stops": sum(f.kind == "stop" for f in faults),
        "recover_s": {kind: _spread([f for f in faults if f.kind == kind]) for kind in ("kill", "stop")},
        "not_recovered": sum(f.recover_s is None for f in faults),
        "faults": [f.as_dict() for f in faults],
        "examples": {
            "failed": [_example(o) for o in failed[:5]],
            "lost": [_example(o) for o in lost[:5]],
            "wrong": [_example(o) for o in wrong[:5]],
        },
    }


def clean(report: dict[str, Any]) -> bool:
    """The run lost nothing: no request lost or failed, every output right, nothing held, every fault healed."""
    keys = (
        "completed_wrong_output", "failed", "lost", "kv_blocks_held_after_idle", "router_in_flight_after_idle",
        "not_recovered",
    )  # fmt: skip
    return report["requests"] > 0 and not any(report[k] for k in keys)


def _spread(faults: list[Fault]) -> dict[str, float | None]:
    times = sorted(f.recover_s for f in faults if f.recover_s is not None)
    if not times:
        return {"p50": None, "max": None}
    return {"p50": round(statistics.median(times), 2), "max": round(times[-1], 2)}


def _example(o: Outcome) -> dict[str, Any]:
    return {"request_id": o.request_id, "status": o.status, "error": o.error[:300], "tokens": len(o.tokens)}


def print_report(report: dict[str, Any], console: Console) -> None:
    table = Table(title="chaos run", show_header=False)
    by_status = ", ".join(f"{k} {v}" for k, v in sorted(report["failed_by_status"].items())) or "-"
    rows = [
        ("requests sent", report["requests"]),
        ("completed, right output", report["completed_right_output"]),
        ("completed, wrong output", report["completed_wrong_output"]),
        ("failed (by status)", f"{report['failed']} ({by_status})"),
        ("lost (no final message, no status)", report["lost"]),
        ("KV blocks held after idle", report["kv_blocks_held_after_idle"]),
        ("router's in-flight count after idle", report["router_in_flight_after_idle"]),
        ("SIGKILLs / SIGSTOPs", f"{report['kills']} / {report['stops']}"),
        ("time to recover after a kill, p50 / max", _times(report["recover_s"]["kill"])),
        ("time to recover after SIGCONT, p50 / max", _times(report["recover_s"]["stop"])),
        ("faults not recovered from", report["not_recovered"]),
    ]
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    faults = Table("at s", "fault", "worker", "pid", "held s", "recovered after s")
    for f in report["faults"]:
        recover = "-" if f["recover_s"] is None else f"{f['recover_s']:.2f}"
        held = f"{f['held_s']:.1f}" if f["kind"] == "stop" else ""
        faults.add_row(f"{f['at_s']:.1f}", f["kind"], f["worker"], str(f["pid"]), held, recover)
    console.print(faults)


def _times(spread: dict[str, float | None]) -> str:
    if spread["p50"] is None:
        return "-"
    return f"{spread['p50']:.2f} s / {spread['max']:.2f} s"

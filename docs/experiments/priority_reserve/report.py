"""Priority classes under a flood, per side: `report.py RUNS [--json rows.json]` reads run.sh's loadgen results
(RUNS: their folder, or a rows.json written before) and prints, per side, the medians over the rounds (their range
in brackets) of what the priority 5 requests got and what the cluster served. Streams in flight (throughput x
mean end-to-end latency, both classes') are what the reserve holds back: the decode worker has 64 batch places."""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

SIDES = ("before", "after")
FIELDS = (
    "completed",
    "rejected",
    "request_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "mean_e2el_ms",
)


def rows_of(runs: Path) -> list[dict[str, Any]]:
    """One row per loadgen result (`CLASS-SIDE-ROUND.json`): its summary's figures and why its requests were shed."""
    rows = []
    for path in sorted(runs.glob("*.json")):
        traffic, side, round_ = path.stem.split("-")
        run = json.loads(path.read_text())  # one rate: its summary at the top
        shed = Counter(r["error"].split(",")[0] for r in run["requests"] if r["status"] == "RESOURCE_EXHAUSTED")
        row = {"class": traffic, "side": side, "round": int(round_)} | {f: run[f] for f in FIELDS}
        rows.append(row | {"shed_by": dict(shed)})
    return rows


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| side | rounds | urgent shed % | urgent req/s | urgent TTFT p50 / p99 ms | flood req/s | all req/s "
        "| TPOT p50 ms | streams in flight |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in SIDES:
        side = [r for r in rows if r["side"] == name]
        rounds = sorted({r["round"] for r in side})
        urgent = [next(r for r in side if r["class"] == "urgent" and r["round"] == n) for n in rounds]
        flood = [next(r for r in side if r["class"] == "flood" and r["round"] == n) for n in rounds]
        shed = [100 * u["rejected"] / (u["completed"] + u["rejected"]) for u in urgent]
        pairs = list(zip(urgent, flood, strict=True))
        both = [u["request_throughput"] + f["request_throughput"] for u, f in pairs]
        held = [sum(r["request_throughput"] * r["mean_e2el_ms"] / 1e3 for r in pair) for pair in pairs]
        lines.append(
            f"| {name} | {len(rounds)} | {median(shed)} | {median([u['request_throughput'] for u in urgent])} | "
            f"{median([u['median_ttft_ms'] for u in urgent])} / {median([u['p99_ttft_ms'] for u in urgent])} | "
            f"{median([f['request_throughput'] for f in flood])} | {median(both)} | "
            f"{median([f['median_tpot_ms'] for f in flood])} | {median(held)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runs", type=Path)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = json.loads(args.runs.read_text()) if args.runs.is_file() else rows_of(args.runs)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()

"""Tenants' fair share, per side: `report.py RUNS [--json rows.json]` reads run.sh's loadgen results (RUNS: their
folder, or a rows.json written before) and prints, per side, the medians over the rounds (their range in
brackets) of what the quiet tenant got and what the cluster served. The machine's speed drifts between rounds
(a decode step's time with it), and throughput with it; the streams in flight (throughput x mean end-to-end
latency, both tenants') are what the reserve holds back: the decode worker has 64 batch places."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

SIDES = ("fifo", "reserve", "both")
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
    """One row per loadgen result (`TENANT-SIDE-ROUND.json`): its summary's figures."""
    rows = []
    for path in sorted(runs.glob("*.json")):
        tenant, side, round_ = path.stem.split("-")
        run = json.loads(path.read_text())  # one rate: its summary at the top
        rows.append({"tenant": tenant, "side": side, "round": int(round_)} | {f: run[f] for f in FIELDS})
    return rows


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| side | rounds | quiet shed % | quiet req/s | quiet TTFT p50 / p99 ms | flood req/s "
        "| all req/s | TPOT p50 ms | streams in flight |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["side"] for r in sorted(rows, key=lambda r: SIDES.index(r["side"]))):
        side = [r for r in rows if r["side"] == name]
        rounds = sorted({r["round"] for r in side})
        quiet = [next(r for r in side if r["tenant"] == "quiet" and r["round"] == n) for n in rounds]
        flood = [next(r for r in side if r["tenant"] == "flood" and r["round"] == n) for n in rounds]
        shed = [100 * q["rejected"] / (q["completed"] + q["rejected"]) for q in quiet]
        pairs = list(zip(quiet, flood, strict=True))
        both = [q["request_throughput"] + f["request_throughput"] for q, f in pairs]
        held = [sum(r["request_throughput"] * r["mean_e2el_ms"] / 1e3 for r in pair) for pair in pairs]
        lines.append(
            f"| {name} | {len(rounds)} | {median(shed)} | {median([q['request_throughput'] for q in quiet])} | "
            f"{median([q['median_ttft_ms'] for q in quiet])} / {median([q['p99_ttft_ms'] for q in quiet])} | "
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

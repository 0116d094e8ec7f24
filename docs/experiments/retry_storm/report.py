"""The table of run.sh's runs: per side, the median over its rounds (and the range) of each figure.

`report.py RUNS_DIR --json rows.json` reads storm.py's result files (capacity-SIDE-ROUND.json, storm-SIDE-ROUND.json)
and keeps each run's figures in rows.json; `report.py rows.json` prints the table again from them."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

FIGURES = (
    ("capacity req/s", "capacity"),
    ("3x: served req/s", "overload_served"),
    ("3x: served / capacity", "overload_share_of_capacity"),
    ("3x: tries/s", "overload_tries"),
    ("3x: dispersion (100 ms)", "overload_dispersion"),
    ("3x: hint p50 ms", "overload_hint_p50"),
    ("3x: served latency p50 s", "overload_lat_p50"),
    ("after: served share", "after_served_share"),
    ("after: tries/s", "after_tries"),
    ("after: latency p99 s", "after_lat_p99"),
    ("after: s to recover", "recovered_s"),
    ("prefills for nobody", "prefills_for_nobody"),
    ("router CPU s", "router_cpu"),
    ("client CPU s", "client_cpu"),
)


def figures(capacity: dict, storm: dict) -> dict[str, float]:
    """One round's figures: phase 1 is the overload, phase 2 the load back at 1x."""
    s, over, after = storm["summary"], storm["summary"]["phase1"], storm["summary"]["phase2"]
    cap = capacity["summary"]["phase0"]["served_per_s"]
    start = s["phase0"]["seconds"] + over["seconds"]  # when the overload ended
    rows = [r for r in s["rows"] if r["from_s"] >= start]
    # Recovered: from the first window after which the tries sent are no more than the arrivals (+10%).
    calm = [sum(r["tries"] for r in rows[k:]) <= 1.1 * sum(r["arrive"] for r in rows[k:]) for k in range(len(rows))]
    recovered = next((rows[k]["from_s"] - start for k, ok in enumerate(calm) if ok), after["seconds"])
    work = s["work"]
    return {
        "capacity": cap,
        "overload_served": over["served_per_s"],
        "overload_share_of_capacity": over["served_per_s"] / cap,
        "overload_tries": over["tries_per_s"],
        "overload_dispersion": over["dispersion_100ms"],
        "overload_hint_p50": over["hint_ms_p10_p50_p90"][1],
        "overload_lat_p50": over["lat_p50"],
        "after_served_share": after["served_share"],
        "after_tries": after["tries_per_s"],
        "after_lat_p99": after["lat_p99"],
        "recovered_s": recovered,
        "prefills_for_nobody": work["prefills_for_nobody"],
        "router_cpu": work.get("router:process_cpu_seconds_total", float("nan")),
        "client_cpu": work["client:cpu_seconds"],
    }


def collect(folder: Path) -> list[dict]:
    rows = []
    for storm in sorted(folder.glob("storm-*.json")):
        side, round_ = storm.stem.removeprefix("storm-").rsplit("-", 1)
        capacity = json.loads((folder / f"capacity-{side}-{round_}.json").read_text())
        rows.append({"side": side, "round": int(round_)} | figures(capacity, json.loads(storm.read_text())))
    return rows


def table(rows: list[dict]) -> str:
    sides = list(dict.fromkeys(r["side"] for r in rows))
    lines = ["| figure | " + " | ".join(f"{s} ({sum(r['side'] == s for r in rows)} rounds)" for s in sides) + " |"]
    lines.append("|---|" + "---|" * len(sides))
    for name, key in FIGURES:
        cells = []
        for side in sides:
            values = [r[key] for r in rows if r["side"] == side]
            cells.append(f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="run.sh's runs folder, or a rows.json")
    ap.add_argument("--json", type=Path, help="write each run's figures here")
    args = ap.parse_args()
    rows = json.loads(args.source.read_text()) if args.source.is_file() else collect(args.source)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()

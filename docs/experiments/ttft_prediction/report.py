"""The tables of run.sh's rows: per side and load, measured/predicted TTFT over the served requests of every round,
the measured TTFT split into its parts against the predicted ones, and what users see against the router's default
TTFT SLO (the median of the rounds).

    python docs/experiments/ttft_prediction/report.py docs/experiments/ttft_prediction
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def wrongly_shed(rows: list[dict], slo_ms: float) -> int:
    """Sheds whose neighbours in send order that were admitted, the one before and the one after, both met the SLO:
    the cluster was serving in time around them (a proxy: no one knows what a shed request would have taken)."""
    count = 0
    for i, row in enumerate(rows):
        if row["status"] != "RESOURCE_EXHAUSTED":
            continue
        before = next((r for r in reversed(rows[:i]) if r["status"] == "OK"), None)
        after = next((r for r in rows[i + 1 :] if r["status"] == "OK"), None)
        count += all(r is not None and r["measured_ms"] <= slo_ms for r in (before, after))
    return count


def users(rows: list[dict], slo_ms: float, seconds: float) -> dict[str, float]:
    ok = [r for r in rows if r["status"] == "OK"]
    good = sum(r["measured_ms"] <= slo_ms for r in ok)
    return {
        "sent": len(rows),
        "attainment": good / len(rows) if rows else float("nan"),
        "goodput": good / seconds,
        "shed": sum(r["status"] == "RESOURCE_EXHAUSTED" for r in rows),
        "admitted_missed": len(ok) - good,
        "wrongly_shed": wrongly_shed(rows, slo_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seconds", type=float, default=40.0, help="of Poisson arrivals per load")
    parser.add_argument("--json", type=Path, help="write the tables' figures here")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {}
    for path in sorted(args.folder.glob("rows-*-*.json")):
        side = path.stem.split("-")[1]
        runs.setdefault(side, []).append(json.loads(path.read_text()))
    out: dict = {}
    print("| side | load | served (rounds pooled) | measured/predicted p50 | p90 |")
    print("|---|---|---|---|---|")
    for side, results in runs.items():
        for load in results[0]["loads"]:
            rows = [r for res in results for r in res["loads"][load]]
            ok = [r for r in rows if r["status"] == "OK" and r.get("predicted_ms")]
            ratio = [r["measured_ms"] / r["predicted_ms"] for r in ok]
            out.setdefault(side, {})[load] = {"served": len(ok), "p50": pct(ratio, 50), "p90": pct(ratio, 90)}
            print(f"| {side} | {load}x | {len(ok)} | {pct(ratio, 50):.2f} | {pct(ratio, 90):.2f} |")
    print("\nmedians, ms: measured parts | predicted parts (served requests, rounds pooled)")
    for side, results in runs.items():
        for load in results[0]["loads"]:
            parts = [r for res in results for r in res["loads"][load] if "measured" in r]
            if not parts:
                continue
            m = {k: statistics.median(r["measured"][k] for r in parts) for k in parts[0]["measured"]}
            p = {k: statistics.median(r["predicted"][k] for r in parts) for k in parts[0]["predicted"]}
            print(
                f"{side} {load}x: "
                + ", ".join(f"{k} {v:.0f}" for k, v in m.items())
                + " | "
                + ", ".join(f"{k} {v:.0f}" for k, v in p.items())
            )
    print("\n| side | load | attainment | goodput req/s | shed | admitted, missed the SLO | wrongly shed (proxy) |")
    print("|---|---|---|---|---|---|---|")
    for side, results in runs.items():
        slo_ms = results[0]["default_ttft_ms"]
        for load in results[0]["loads"]:
            if load == "0":
                continue
            per_round = [users(res["loads"][load], slo_ms, args.seconds) for res in results]
            med = {k: statistics.median(u[k] for u in per_round) for k in per_round[0]}
            out[side][load]["users"] = med
            print(
                f"| {side} | {load}x | {med['attainment']:.0%} | {med['goodput']:.2f} | {med['shed']:g} | "
                f"{med['admitted_missed']:g} | {med['wrongly_shed']:g} |"
            )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

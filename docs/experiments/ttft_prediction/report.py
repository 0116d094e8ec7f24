"""The tables of run.sh's rows: per side and load, measured/predicted TTFT over the served requests of every round,
the measured TTFT split into its parts against the predicted ones, and what users see against the router's default
TTFT SLO (the median of the rounds).

    python docs/experiments/ttft_prediction/report.py docs/experiments/ttft_prediction
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

TIGHT_SLOS_MS = (25.0, 50.0, 100.0)


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


def tight_slo(rows: list[dict], slo_ms: float) -> tuple[int, int]:
    """(admitted yet missed, refused yet met) of requests sent alone, had each asked for a TTFT SLO of `slo_ms`:
    admission admits an idle cluster's request whose predicted TTFT is within its SLO."""
    admitted_missed = sum(r["predicted_ms"] <= slo_ms < r["measured_ms"] for r in rows)
    refused_met = sum(r["measured_ms"] <= slo_ms < r["predicted_ms"] for r in rows)
    return admitted_missed, refused_met


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
    for path in sorted(args.folder.glob("rows-*-*.json*")):  # rows-<side>-<round>.json, or .json.gz
        side = path.name.split("-")[1]
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        runs.setdefault(side, []).append(json.loads(text))
    out: dict = {}
    print("| side | load | served (rounds pooled) | measured/predicted p10 | p50 | p90 ", end="")
    print("| p50, shorter half of the prompts | longer half |")
    print("|---|---|---|---|---|---|---|---|")
    for side, results in runs.items():
        for load in results[0]["loads"]:
            rows = [r for res in results for r in res["loads"][load]]
            ok = [r for r in rows if r["status"] == "OK" and r.get("predicted_ms")]
            ratio = [r["measured_ms"] / r["predicted_ms"] for r in ok]
            median_tokens = statistics.median(r["prompt_tokens"] for r in ok)
            halves = [
                [r["measured_ms"] / r["predicted_ms"] for r in ok if (r["prompt_tokens"] > median_tokens) == longer]
                for longer in (False, True)
            ]
            p10, p50, p90, short, long = pct(ratio, 10), pct(ratio, 50), pct(ratio, 90), *(pct(h, 50) for h in halves)
            out.setdefault(side, {})[load] = {"served": len(ok), "p10": p10, "p50": p50, "p90": p90}
            out[side][load] |= {"p50_shorter_half": short, "p50_longer_half": long}
            print(f"| {side} | {load}x | {len(ok)} | {p10:.2f} | {p50:.2f} | {p90:.2f} | {short:.2f} | {long:.2f} |")
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
    print("\nRequests sent one at a time (rounds pooled), judged against an explicit TTFT SLO offline: admitted")
    print("(predicted within it) yet measured past it / refused (predicted past it) yet measured within it")
    print("\n| side | " + " | ".join(f"SLO {slo:g} ms" for slo in TIGHT_SLOS_MS) + " |")
    print("|---|" + "---|" * len(TIGHT_SLOS_MS))
    for side, results in runs.items():
        ok = [r for res in results for r in res["loads"]["0"] if r["status"] == "OK" and r.get("predicted_ms")]
        judged = [tight_slo(ok, slo) for slo in TIGHT_SLOS_MS]
        out[side]["0"]["tight_slo"] = dict(zip(TIGHT_SLOS_MS, judged, strict=True))
        print(f"| {side} | " + " | ".join(f"{a} / {r} of {len(ok)}" for a, r in judged) + " |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""The tables of run.sh's rows: per side, load and class, what was sent, served, shed and met its TTFT SLO, the
goodput (requests that met it per second), the TTFT of the served ones and how far the router's prediction was
from it, pooled over the rounds.

    python docs/experiments/prefill_head_of_line/report.py docs/experiments/prefill_head_of_line
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# before: first come, first served; after: short prompts first, as this change leaves it ("final"), and as its two
# earlier versions priced a short prompt's wait (v1: a long prompt's share of its own seconds per chunk, held for all
# its prefill; v2: the chunk in flight priced by the profile)
SIDES = ("fcfs", "v1", "v2", "final", "base", "stretch")
KINDS = ("short", "long")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def during_long(rows: list[dict]) -> list[dict]:
    """The short requests sent while a long one sent before them had no first token yet (in its prefill or queued)."""
    longs = [(r["sent_s"], r["first_token_s"]) for r in rows if r["kind"] == "long" and "first_token_s" in r]
    return [r for r in rows if r["kind"] == "short" and any(a < r["sent_s"] < b for a, b in longs)]


def row(rows: list[dict], seconds: float) -> str:
    ok = [r for r in rows if r["status"] == "OK"]
    met = sum(r["measured_ms"] <= r["slo_ms"] for r in ok)
    shed = sum(r["status"] == "RESOURCE_EXHAUSTED" for r in rows)
    ttft = [r["measured_ms"] / 1e3 for r in ok]
    ratio = [r["measured_ms"] / r["predicted_ms"] for r in ok if r.get("predicted_ms")]
    cells = [len(rows), len(ok), shed, len(rows) - len(ok) - shed, f"{met} ({met / max(1, len(rows)):.0%})"]
    cells += [f"{met / seconds:.3f}", f"{pct(ttft, 50):.2f} / {pct(ttft, 90):.2f}"]
    cells += [f"{pct(ratio, 50):.2f} / {pct(ratio, 90):.2f}"]
    return "".join(f"| {c} " for c in cells) + "|"


def rounds(folder: Path) -> None:
    """Per round: the long prompts refused as past their SLO on an idle worker (the profile measured at the workers'
    start prices them; it varies run to run on a shared host) change how much the short ones wait for."""
    print(
        "| side, round | load | short: met / sent | long: served / met / refused idle (INVALID_ARGUMENT) / shed "
        "| short sent during a long one's prefill: served / met |"
    )
    print("|---|---|---|---|---|")
    for side in SIDES:
        for path in sorted(folder.glob(f"rows-{side}-*.json")):
            run = json.loads(path.read_text())
            for load, rows in run["loads"].items():
                if load == "alone":
                    continue
                short = [r for r in rows if r["kind"] == "short"]
                long = [r for r in rows if r["kind"] == "long"]
                during = during_long(rows)
                met = lambda rs: sum(r["status"] == "OK" and r["measured_ms"] <= r["slo_ms"] for r in rs)  # noqa: E731
                count = lambda rs, s: sum(r["status"] == s for r in rs)  # noqa: E731
                print(
                    f"| {side} {path.stem.rsplit('-', 1)[1]} | {load} | {met(short)} / {len(short)} "
                    f"| {count(long, 'OK')} / {met(long)} / {count(long, 'INVALID_ARGUMENT')} / "
                    f"{count(long, 'RESOURCE_EXHAUSTED')} | {count(during, 'OK')} / {met(during)} of {len(during)} |"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    folder = parser.parse_args().folder
    print(
        "| side | load | class | sent | served | shed | other errors | met SLO | goodput req/s | TTFT p50 / p90 s "
        "| measured/predicted p50 / p90 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for side in SIDES:
        runs = [json.loads(p.read_text()) for p in sorted(folder.glob(f"rows-{side}-*.json"))]
        if not runs:
            continue
        seconds = runs[0]["args"]["seconds"] * len(runs)
        for load in runs[0]["loads"]:
            for kind in KINDS:
                rows = [r for run in runs for r in run["loads"][load] if r["kind"] == kind]
                span = seconds if load != "alone" else float("inf")
                print(f"| {side} | {load} | {kind} " + row(rows, span))
            if load != "alone":
                rows = [r for run in runs for r in during_long(run["loads"][load])]
                print(f"| {side} | {load} | short, sent during a long one's prefill " + row(rows, seconds))
    print()
    rounds(folder)


if __name__ == "__main__":
    main()

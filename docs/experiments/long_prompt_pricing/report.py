"""Tabulates pricing_bench.py's JSON lines: per prompt length, with the profile measured quiet or under load, what
each profile priced the prompt at over what it took (median and range over rounds), and how many rounds would have
refused it as impossible at a TTFT SLO it met."""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("rows")
    ap.add_argument("--slo-s", type=float, default=40.0)
    args = ap.parse_args()
    groups: defaultdict[tuple[bool, int], list[dict]] = defaultdict(list)
    with open(args.rows) as f:
        for line in f:
            row = json.loads(line)
            groups[row["profile_under_load"], row["tokens"]].append(row)
    print(
        f"| profile measured | prompt tokens | rounds | took s (median) | whole prompts: priced/took median (range) "
        f"| chunks at depth: priced/took median (range) | refused at {args.slo_s:.0f} s though met: whole / depth |"
    )
    print("|---|---|---|---|---|---|---|")
    for (loaded, tokens), rows in sorted(groups.items()):
        cells = []
        for side in ("whole_s", "depth_s"):
            ratios = [r[side] / r["measured_s"] for r in rows]
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        refused = [sum(r[side] > args.slo_s >= r["measured_s"] for r in rows) for side in ("whole_s", "depth_s")]
        took = statistics.median(r["measured_s"] for r in rows)
        print(
            f"| {'under load' if loaded else 'quiet'} | {tokens} | {len(rows)} | {took:.1f} | {cells[0]} | {cells[1]} "
            f"| {refused[0]} / {refused[1]} |"
        )
    for loaded in (False, True):
        rows = [r for (ld, _), rs in groups.items() if ld == loaded for r in rs]
        if rows:
            whole = statistics.median(r["whole_profile_took_s"] for r in rows)
            depth = statistics.median(r["depth_profile_took_s"] for r in rows)
            print(
                f"\nprofile {'under load' if loaded else 'quiet'}: whole prompts {whole:.1f} s, "
                f"chunks at depth {depth:.1f} s"
            )


if __name__ == "__main__":
    main()

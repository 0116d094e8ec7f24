"""A decode step's attention over long contexts on the CPU, with glibc's mmap threshold as it is by default and as
engine/host_heap.py raises it: each side in its own process (the setting is per process), alternated, one layer's
gather and attention timed 30 times (a 30-layer model's step). Prints a line per shape and side, then ratios."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SHAPES = ((1, 2048), (8, 2048), (1, 6000), (8, 6000))


def child(raise_threshold: bool) -> None:
    import torch

    from pdserve.engine.attention import DecodeGroup, _decode_attention
    from pdserve.engine.host_heap import keep_large_allocations_in_heap

    if raise_threshold:
        assert keep_large_allocations_in_heap()
    torch.set_num_threads(2)
    block, kv_heads, head_dim, heads = 16, 3, 64, 9  # smollm2-135m's attention
    cache = torch.randn(2, 8 * 6016 // block + 8, block, kv_heads, head_dim)
    out = {}
    for batch, context in SHAPES:
        per = -(-context // block)
        mask = torch.zeros(batch, 1, 1, per * block)
        mask[..., context:] = float("-inf")
        group = DecodeGroup(None, torch.arange(batch * per), mask)
        q = torch.randn(batch, heads, head_dim)
        _decode_attention(q, cache, group)
        start = time.perf_counter()
        for _ in range(30):
            _decode_attention(q, cache, group)
        out[f"{batch}x{context}"] = time.perf_counter() - start
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=["default", "raised"])
    args = ap.parse_args()
    if args.child:
        child(args.child == "raised")
        return
    runs: dict[str, list[dict[str, float]]] = {"default": [], "raised": []}
    for _ in range(args.rounds):
        for side in runs:
            line = subprocess.run([sys.executable, __file__, "--child", side], capture_output=True, text=True)
            runs[side].append(json.loads(line.stdout))
    for batch, context in SHAPES:
        key = f"{batch}x{context}"
        default = statistics.median(r[key] for r in runs["default"])
        raised = statistics.median(r[key] for r in runs["raised"])
        print(
            f"{key}: default {default * 1e3:.0f} ms a step ({default * 1e6 / (batch * context):.1f} us a token), "
            f"raised {raised * 1e3:.0f} ms ({raised * 1e6 / (batch * context):.1f} us a token), "
            f"default/raised {default / raised:.2f}"
        )


if __name__ == "__main__":
    main()

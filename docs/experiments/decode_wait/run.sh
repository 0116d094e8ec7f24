#!/usr/bin/env bash
# The router's TTFT prediction before (8054151) and after counting the decode worker's step wait: each side's
# cluster (smollm2-135m, 1P:1D, one thread per worker) probed idle and behind 4 and 16 decoding streams, two
# rounds, alternately. From the repository root; about 12 minutes on two cores.
set -euo pipefail
out=$PWD/docs/experiments/decode_wait
script=$out/decode_wait.py
before=/tmp/pdserve-decode-wait-before
[ -d "$before" ] || git worktree add --detach "$before" 8054151
for round in 1 2; do
  for side in before after; do
    dir=$PWD; [ "$side" = before ] && dir=$before
    echo "$side, round $round:"
    (cd "$dir" && PYTHONPATH=src:. python "$script" --streams 4 16 --probes 12 --rows "$out/rows-$side-$round.json")
  done
done

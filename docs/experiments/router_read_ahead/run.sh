#!/usr/bin/env bash
# The router's read-ahead (2450e5b, reverted in the next commit) against the code before it (4d6c326): clusters of
# each started alternately, replaying the same decode-heavy traces (128 ± 50% in, 256 ± 50% out) with
# ../stream_coalescing/ab.py: three rounds as deployed, then two with the router's threads at nice 19 (below the
# workers' 15, so the router is the process starved of CPU). From the repository root; about 25 minutes on two
# cores; needs a quiet machine.
set -euo pipefail
out=$PWD/docs/experiments/router_read_ahead
ab=$PWD/docs/experiments/stream_coalescing/ab.py
before=/tmp/pdserve-read-ahead-before
after=/tmp/pdserve-read-ahead-after
[ -d "$before" ] || git worktree add --detach "$before" 4d6c326
[ -d "$after" ] || git worktree add --detach "$after" 2450e5b
rm -f "$out/rows.json" "$out/rows-router-nice-19.json"
run() {  # side, rows file, extra ab.py flags
  dir=$before; [ "$1" = after ] && dir=$after
  (cd "$dir" && PYTHONPATH=src:scripts:. python "$ab" --side "$1" --json "$out/$2" --num-requests 150 \
    --input-len 128 --output-len 256 "${@:3}")
}
for round in 1 2 3; do
  for side in before after; do run "$side" rows.json --rates 6,12,18; done
done
for round in 1 2; do
  for side in before after; do run "$side" rows-router-nice-19.json --rates 6,12 --router-nice 19; done
done

#!/usr/bin/env bash
# Stream coalescing before and after: clusters of the code before (a99162e) and after, started alternately
# (before, after; three rounds), each replaying the same traces (ab.py). From the repository root; about 17
# minutes on two cores; needs a quiet machine.
set -euo pipefail
out=$PWD/docs/experiments/stream_coalescing
before=/tmp/pdserve-coalescing-before
[ -d "$before" ] || git worktree add --detach "$before" a99162e
rm -f "$out/rows.json"
for round in 1 2 3; do
  for side in before after; do
    dir=$PWD; [ "$side" = before ] && dir=$before
    (cd "$dir" && PYTHONPATH=src:scripts:. python "$out/ab.py" --side "$side" --json "$out/rows.json")
  done
done

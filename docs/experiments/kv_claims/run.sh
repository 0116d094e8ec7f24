#!/usr/bin/env bash
# KV claims before and after: clusters of the code before (5bb3439) and after, started alternately (before, after;
# two rounds of three trials each), each sending one large request into a decode worker that small streams keep
# full (starvation.py). From the repository root; about 6 minutes on two cores; needs a quiet machine.
set -euo pipefail
out=$PWD/docs/experiments/kv_claims
before=/tmp/pdserve-claims-before
[ -d "$before" ] || git worktree add --detach "$before" 5bb3439
rm -f "$out/rows.json"
for round in 1 2; do
  for side in before after; do
    dir=$PWD; [ "$side" = before ] && dir=$before
    (cd "$dir" && PYTHONPATH=src:. python "$out/starvation.py" --side "$side" --trials 3 --json "$out/rows.json")
  done
done
python "$out/starvation.py" --report "$out/rows.json"

#!/usr/bin/env bash
# KV claims with two routers, before and after they were shared through Redis: clusters of the code before
# (ff93d6f: each router's claims its own) and after, started alternately (two rounds of three trials each), each with
# a second router beside `up`'s on one redis-server (starvation.py --routers 2). From the repository root; about 10
# minutes on two cores; needs a quiet machine.
set -euo pipefail
out=$PWD/docs/experiments/kv_claims
before=/tmp/pdserve-shared-claims-before
[ -d "$before" ] || git worktree add --detach "$before" ff93d6f
rm -f "$out/rows-two-routers.json"
for round in 1 2; do
  for side in before after; do
    dir=$PWD; [ "$side" = before ] && dir=$before
    (cd "$dir" && PYTHONPATH=src:. python "$out/starvation.py" --side "$side" --routers 2 --trials 3 \
      --json "$out/rows-two-routers.json")
  done
done
PYTHONPATH=src:. python "$out/starvation.py" --report "$out/rows-two-routers.json"

#!/usr/bin/env bash
# The figures in README.md, from the repository root (with .venv): the benchmark run alternately against the code
# before these changes (BEFORE: a checkout of f68f772, e.g. `git worktree add /tmp/before f68f772`) and after, twice
# each, then the fleet's Redis load after (model and runs) and before (the model's units).
set -euo pipefail
BEFORE=${BEFORE:?a checkout of f68f772}
here=docs/experiments/router_at_scale
for i in 1 2; do
  PYTHONPATH="$BEFORE/src:$BEFORE" .venv/bin/python $here/scale_bench.py --json $here/rows-before-$i.json \
    > $here/results-before-$i.txt
  PYTHONPATH=src:. .venv/bin/python $here/scale_bench.py --json $here/rows-after-$i.json > $here/results-after-$i.txt
done
PYTHONPATH=src:. .venv/bin/python $here/fleet_redis_load.py --model-for 8x16,8x64,8x256 --run 2x16,8x64,8x256 \
  > $here/fleet-after.txt
PYTHONPATH="$BEFORE/src:$BEFORE" .venv/bin/python $here/fleet_redis_load.py --model-for 8x256 > $here/fleet-before.txt

#!/usr/bin/env bash
# The routers' slot cache's figures in README.md, from the repository root (with .venv): this benchmark and
# fleet_redis_load's units, Redis backend, alternately against the build before the cache (BEFORE: a checkout of
# 85a171d) and after, twice each.
set -euo pipefail
BEFORE=${BEFORE:?a checkout of 85a171d}
here=docs/experiments/router_at_scale
echo "# fleet_redis_load.py --model-for 8x256 --repeats 40, units only, alternately before (85a171d) and after the" \
  "routers' slot cache; columns: commands, KB in, KB out, Redis CPU ms" > $here/fleet-slots.txt
for i in 1 2; do
  for build in before after; do
    if [ $build = before ]; then path="$BEFORE/src:$BEFORE"; else path=src:.; fi
    PYTHONPATH="$path" .venv/bin/python $here/scale_bench.py --sizes 4,64,256 --backends redis \
      --json $here/rows-slots-$build-$i.json > $here/results-slots-$build-$i.txt
    echo "== $build" >> $here/fleet-slots.txt
    PYTHONPATH="$path:$here" .venv/bin/python $here/fleet_redis_load.py --model-for 8x256 --repeats 40 \
      | grep -E 'heartbeat|request:' >> $here/fleet-slots.txt
  done
done

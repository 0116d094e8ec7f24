#!/usr/bin/env bash
# The holders index's figures in README.md, from the repository root (with .venv): this benchmark, Redis backend,
# alternately against the build before the holders index (BEFORE: a checkout of 575d263) and after, twice each.
set -euo pipefail
BEFORE=${BEFORE:?a checkout of 575d263}
here=docs/experiments/router_at_scale
for i in 1 2; do
  PYTHONPATH="$BEFORE/src:$BEFORE" .venv/bin/python $here/scale_bench.py --sizes 4,64,256 --backends redis \
    --json $here/rows-holders-before-$i.json > $here/results-holders-before-$i.txt
  PYTHONPATH=src:. .venv/bin/python $here/scale_bench.py --sizes 4,64,256 --backends redis \
    --json $here/rows-holders-after-$i.json > $here/results-holders-after-$i.txt
done

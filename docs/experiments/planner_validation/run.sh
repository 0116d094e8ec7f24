#!/usr/bin/env bash
# The planner's simulator against the local cluster (docs/planning.md, "The simulator against the local cluster").
# From the repository root; about 15 minutes on two cores. Needs a quiet machine: the host's other programs'
# CPU is charged to each row, but their bursts still move a row's p90. The files are suffixed with the run's name
# (the first argument, e.g. run6), so earlier runs' files stay.
set -euo pipefail
name=${1:?usage: run.sh RUN_NAME}
out=docs/experiments/planner_validation
pdserve profile --model tiny-random --threads 1 --kv-cache-gb 0.25 --out "$out/profile-$name.json"
PYTHONPATH=src:. python scripts/validate_planner.py --model tiny-random --profile "$out/profile-$name.json" \
  --configs 1:1,2:1,1:2 --rates 4,10,16 --repeat 3 --num-requests 150 --input-len 1024 --output-len 32 \
  --slo-ttft-ms 500 --slo-tpot-ms 50 --calibrate --save-profile "$out/calibrated_profile-$name.json" \
  --json "$out/rows-$name.json" | tee "$out/results-$name.txt"

#!/usr/bin/env bash
# The mixed-prompt validation with a profile and calibration of its own run (README, "on a quiet host"): from the
# repository root, about 4 minutes on two cores. Needs a quiet machine.
set -euo pipefail
out=docs/experiments/planner_validation/mixed
pdserve profile --model tiny-random --threads 1 --kv-cache-gb 0.25 --out "$out/profile-quiet.json"
PYTHONPATH=src:. python scripts/validate_planner.py --model tiny-random --profile "$out/profile-quiet.json" \
  --configs 1:1 --rates 8 --repeat 1 --num-requests 150 --input-len 1024 --output-len 32 \
  --slo-ttft-ms 500 --slo-tpot-ms 50 --calibrate --save-profile "$out/calibrated_profile-quiet.json" \
  | tee "$out/calibration-quiet.txt"
PYTHONPATH=src:.:scripts python docs/experiments/planner_validation/mixed/run_mixed.py \
  --profile "$out/calibrated_profile-quiet.json" --rates 8,16 --repeat 2 --json "$out/rows-quiet.json"

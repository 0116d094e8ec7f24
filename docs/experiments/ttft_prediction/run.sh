#!/usr/bin/env bash
# The router's TTFT predictions under Poisson load before (9ffbfed: the queue priced by the profile alone) and after
# (this checkout: a factor learned from loaded requests, services/router/load_calibration.py), alternately,
# three rounds: each a fresh 1P:1D smollm2-135m cluster with the router's --default-ttft-ms 2000, 8 requests one at a
# time, then 40 s of Poisson arrivals at 0.5x, 0.8x and 1.0x of 0.8 req/s (what the cluster served with 3 requests
# always in flight on this 2-core VM; prompts log-normal around 128 tokens, at most 512; 16 output tokens).
# report.py prints the tables. From the repository root, its venv active; about 25 minutes.
set -euo pipefail
out=$PWD/docs/experiments/ttft_prediction
before=${BEFORE:-/tmp/pdserve-ttft-prediction-before}
[ -d "$before" ] || git worktree add --detach "$before" 9ffbfed
for round in 1 2 3; do
  for side in before after; do
    code=$PWD; [ "$side" = before ] && code=$before
    echo "$side, round $round:"
    # From its own tree: `pdserve up` runs `python -m`, which imports the working directory's services/ first.
    (cd "$code" && PYTHONPATH=$code/src:$code python "$out/ttft_prediction.py" --model smollm2-135m \
      --prompt-median 128 --prompt-max 512 --capacity 0.8 --isolated 8 --loads 0.5 0.8 1.0 --seconds 40 \
      --default-ttft-ms 2000 --rows "$out/rows-$side-$round.json")
  done
done
python "$out/report.py" "$out"

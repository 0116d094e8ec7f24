#!/usr/bin/env bash
# The router's TTFT predictions before (575d263: no fixed cost, the factor alone) and after (this checkout: a first
# token's fixed cost learned apart from the factor, services/router/fixed_cost.py), alternately, three rounds
# (ROUNDS; FIRST_ROUND to add rounds to earlier ones): each a fresh 1P:1D cluster of tiny-random (30 requests one at
# a time, then 30 s of Poisson arrivals at 0.5x and 1.0x of 15 req/s, median 256-token prompts) and of smollm2-135m
# (12 one at a time, then 40 s at 1.0x of 0.8 req/s, median 128-token prompts, the router's --default-ttft-ms 2000).
# report.py prints each model's tables. From the repository root, its venv active; about 10 minutes a round.
set -euo pipefail
out=$PWD/docs/experiments/ttft_prediction
before=${BEFORE:-/tmp/pdserve-ttft-fixed-cost-before}
[ -d "$before" ] || git worktree add --detach "$before" 575d263
for round in $(seq "${FIRST_ROUND:-1}" "${ROUNDS:-3}"); do
  for side in before after; do
    code=$PWD; [ "$side" = before ] && code=$before
    echo "$side, round $round:"
    # From its own tree: `pdserve up` runs `python -m`, which imports the working directory's services/ first.
    (cd "$code" && PYTHONPATH=$code/src:$code python "$out/ttft_prediction.py" --model tiny-random \
      --capacity 15 --isolated 30 --loads 0.5 1.0 --seconds 30 \
      --rows "$out/fixed_cost/tiny-random/rows-$side-$round.json")
    (cd "$code" && PYTHONPATH=$code/src:$code python "$out/ttft_prediction.py" --model smollm2-135m \
      --prompt-median 128 --prompt-max 512 --capacity 0.8 --isolated 12 --loads 1.0 --seconds 40 \
      --default-ttft-ms 2000 --rows "$out/fixed_cost/smollm2-135m/rows-$side-$round.json")
  done
done
gzip -9f "$out"/fixed_cost/*/rows-*.json
for model in tiny-random smollm2-135m; do
  echo "$model:"
  python "$out/report.py" "$out/fixed_cost/$model"
done

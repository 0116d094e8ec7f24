#!/usr/bin/env bash
# Priority classes under a flood, two sides alternately, three rounds: "before" (commit fbf5d89: a priority only
# shortens the prefill queue bound, and orders the workers' waiting prompts) and "after" (this checkout: the
# reserve of batch places, KV blocks and queue room for a class above, and priority-aware preemption). Each: a
# 1P:1D tiny-random cluster and two loadgen runs at once, "flood" at priority 0 and 60 req/s (about three times
# what the cluster serves on two cores) and "urgent" at priority 5 and 2 req/s, 512 prompt tokens and 64 output
# tokens each, Poisson arrivals, 30 s. report.py keeps each result's figures in rows.json and prints the medians.
# From the repository root, its venv active; about 5 minutes; needs a quiet machine.
set -euo pipefail
here=$PWD
out=$here/docs/experiments/priority_reserve
before=/tmp/pdserve-priority-before
[ -d "$before" ] || git worktree add --detach "$before" fbf5d89
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/runs"
for round in 1 2 3; do
  for side in before:$before after:$here; do
    IFS=: read -r label code <<< "$side"
    (cd "$code" && PYTHONPATH=$code/src:$code exec python -m services.main up --model tiny-random \
      --mode disaggregated --prefill 1 --decode 1 --port 50761) > "$work/up.log" 2>&1 &
    up=$!
    until grep -q '^ready' "$work/up.log"; do kill -0 $up; sleep 1; done
    common=(--addr 127.0.0.1:50761 --model tiny-random --random-input-len 512 --random-output-len 64
            --warmup-requests 0)
    python -m loadgen "${common[@]}" --request-rate 60 --num-prompts 1800 --seed 1 \
      --result-json "$work/runs/flood-$label-$round.json" > "$work/flood.log" 2>&1 &
    flood=$!
    python -m loadgen "${common[@]}" --priority 5 --request-rate 2 --num-prompts 60 --seed 2 \
      --result-json "$work/runs/urgent-$label-$round.json" > "$work/urgent.log" 2>&1 || true
    wait $flood || true
    kill -INT $up; wait $up || true
  done
done
python "$out/report.py" "$work/runs" --json "$out/rows.json"

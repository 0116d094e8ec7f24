#!/usr/bin/env bash
# Overload with clients that retry as the hint says, three sides alternately, three rounds: "before" (commit 21089a7:
# admission's own hint, the same for every request shed together), "before-jitter" (the same cluster, clients that
# wait a uniform 0.5-1.5x of the hint) and "after" (this checkout: hints paced over the rate the router admits,
# services/router/retry_pacing.py). Each: a fresh 1P:1D tiny-random cluster, first its capacity (3x the rate for 20 s,
# no retries: what it serves), then storm.py's phases (1x for 20 s, 3x for 30 s, 1x for 40 s; 1x = 20 req/s, 256
# prompt tokens, 32 output tokens, each caller giving up 10 s after it first sent). report.py prints the medians.
# From the repository root, its venv active; about 25 minutes; needs a quiet machine.
set -euo pipefail
here=$PWD
out=$here/docs/experiments/retry_storm
before=/tmp/pdserve-retry-storm-before
[ -d "$before" ] || git worktree add --detach "$before" 21089a7
work=${WORK:-$(mktemp -d)}
mkdir -p "$work/runs"
for round in 1 2 3; do
  for side in before:$before:none before-jitter:$before:half after:$here:none; do
    IFS=: read -r label code jitter <<< "$side"
    (cd "$code" && PYTHONPATH=$code/src:$code exec python -m services.main up --model tiny-random \
      --mode disaggregated --prefill 1 --decode 1 --port 50781 --metrics-port 50782) > "$work/up.log" 2>&1 &
    up=$!
    trap 'kill -INT $up 2>/dev/null || true' EXIT
    until grep -q '^ready' "$work/up.log"; do kill -0 $up; sleep 1; done
    storm=(python "$out/storm.py" --addr 127.0.0.1:50781 --router-metrics 127.0.0.1:50782 --rate 20)
    "${storm[@]}" --phases 3:20 --client-jitter never --json "$work/runs/capacity-$label-$round.json" > /dev/null
    "${storm[@]}" --client-jitter "$jitter" --json "$work/runs/storm-$label-$round.json" \
      > "$work/runs/storm-$label-$round.txt"
    kill -INT $up; wait $up || true
  done
done
python "$out/report.py" "$work/runs" --json "$out/rows.json"

#!/usr/bin/env bash
# `make demo`: a local cluster (1 prefill + 1 decode) on the real model, three streamed chat answers, stop.
set -euo pipefail
PDSERVE=${PDSERVE:-.venv/bin/pdserve}
MODEL=${MODEL:-smollm2-135m}
PORT=${PORT:-50051}
LOG=$(mktemp -t pdserve-demo.XXXXXX.log)

"$PDSERVE" up --model "$MODEL" --mode disaggregated --prefill 1 --decode 1 --port "$PORT" >"$LOG" 2>&1 &
CLUSTER=$!
trap 'kill -TERM $CLUSTER 2>/dev/null; wait $CLUSTER 2>/dev/null || true' EXIT

echo "starting the cluster (log: $LOG) ..."
for _ in $(seq 1 300); do
  grep -q '^ready ' "$LOG" && break
  kill -0 $CLUSTER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 1
done
grep '^ready ' "$LOG"

for prompt in "What is the capital of France?" \
              "Explain in two sentences why the sky is blue." \
              "Write a haiku about paged attention."; do
  echo
  echo ">>> $prompt"
  "$PDSERVE" client --addr "127.0.0.1:$PORT" --chat --max-tokens 64 --prompt "$prompt"
done
echo
echo "stopping the cluster ..."

#!/bin/bash
# The HTTP path's overhead: one workload through pdserve's gRPC API and its OpenAI-compatible HTTP API,
# against the same cluster, one request at a time (so the difference is per request, not queueing), twice
# each, alternating, since this shared machine's speed drifts.
set -u
cd "$(dirname "$0")/../../.."

PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/http-overhead}
MODEL=${MODEL:-tiny-random}
# Each run its own seed: prompts another run sent would be served from the prefix cache.
WORKLOAD="--model $MODEL --dataset-name random --random-input-len 128 --random-output-len 32
  --num-prompts 60 --max-concurrency 1"
mkdir -p $OUT
$PY -m services.main up --model $MODEL --prefill 1 --decode 1 --port 50410 --http-port 50411 > $OUT/cluster.log 2>&1 &
pid=$!
until grep -q "^ready" $OUT/cluster.log; do sleep 1; kill -0 $pid || exit 1; done
echo "$(date +%T) ready; load: $(cat /proc/loadavg)"
for round in 1 2; do
  $PY -m loadgen --backend grpc --addr 127.0.0.1:50410 $WORKLOAD --seed $((2 * round)) \
    --result-json $OUT/grpc-$round.json > $OUT/grpc-$round.txt 2>&1
  $PY -m loadgen --backend openai --base-url http://127.0.0.1:50411 $WORKLOAD --seed $((2 * round + 1)) \
    --result-json $OUT/openai-$round.json > $OUT/openai-$round.txt 2>&1
  echo "$(date +%T) round $round done; load: $(cat /proc/loadavg)"
done
kill -TERM $pid; wait $pid
for round in 1 2; do $PY -m loadgen compare $OUT/grpc-$round.json $OUT/openai-$round.json; done > $OUT/compare.txt 2>&1
echo "$(date +%T) all done"

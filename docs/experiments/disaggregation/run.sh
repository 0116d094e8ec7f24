#!/bin/bash
# The disaggregation experiment: one prefill-heavy workload, a rate sweep, against each mode in turn.
set -u
cd "$(dirname "$0")/../../.."

OUT=${OUT:-/tmp/loadgen-exp}
WORKLOAD="--model smollm2-135m --dataset-name random --random-input-len 1024 --random-output-len 64
  --num-prompts 24 --request-rate 0.1,0.2,0.3,0.4 --burstiness 1 --goodput ttft:10000 tpot:100 --seed 0"
run_mode() {  # name, pdserve up flags...
  local name=$1; shift
  mkdir -p $OUT; printf "[router]\ndefault_ttft_ms = 10000.0\n" > $OUT/router.toml
  .venv/bin/pdserve up --model smollm2-135m --router-config $OUT/router.toml --port 50400 "$@" > $OUT/$name-cluster.log 2>&1 &
  local pid=$!
  until grep -q "^ready" $OUT/$name-cluster.log; do sleep 1; kill -0 $pid || return 1; done
  echo "$(date +%T) $name ready; load: $(cat /proc/loadavg)"
  .venv/bin/loadgen --addr 127.0.0.1:50400 $WORKLOAD --result-json $OUT/$name.json --plot-dir $OUT/$name > $OUT/$name-loadgen.txt 2>&1
  echo "$(date +%T) $name done rc=$?; load: $(cat /proc/loadavg)"
  kill -TERM $pid; wait $pid
}
run_mode disaggregated --mode disaggregated --prefill 1 --decode 1
run_mode colocated --mode colocated --workers 2
.venv/bin/loadgen compare $OUT/colocated.json $OUT/disaggregated.json --plot-dir $OUT/compare > $OUT/compare.txt 2>&1
echo "$(date +%T) all done"

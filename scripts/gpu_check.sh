#!/bin/bash
# The checks to run on a machine with a GPU, as one command: the CUDA
# tests (engine float32 on CUDA == CPU, decode in CUDA graphs == eager, bfloat16 on CUDA, a transfer of CUDA
# caches over gloo), then the engine and transfer benches on CUDA, the engine's once more with decode eager
# (--decode-graphs off) to show what the graphs buy. NCCL needs two GPUs (one rank per GPU), so the transfer bench forces gloo.
# MODEL=tiny-random limits it to the model that needs no cache (SmolLM2's converted folder is too big to carry);
# PY picks the interpreter (the device machine brings its own torch). Logs land in $OUT when it is set.
set -u -o pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2-135m}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
LOGS=${OUT:-/tmp}
export PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
filter=$([ "$MODEL" = tiny-random ] && echo "tiny or device" || echo "")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$PY" -m pytest -q -p no:cacheprovider -m cuda -k "$filter" tests/unit/engine/test_cuda_engine.py \
  tests/unit/transfer/test_device_caches.py 2>&1 | tee "$LOGS/cuda_tests.log"
"$PY" -m pdserve.cli bench transfer --device cuda --backend gloo --repeats 5 2>&1 | tee "$LOGS/transfer_bench.log"
"$PY" -m pdserve.cli bench engine --model "$MODEL" --device cuda --dtype bfloat16 --batch-sizes 1,8,32,128 \
  --compare transformers 2>&1 | tee "$LOGS/engine_bench.log"
"$PY" -m pdserve.cli bench engine --model "$MODEL" --device cuda --dtype bfloat16 --batch-sizes 1,32 \
  --compare none --rounds 2 --decode-graphs off 2>&1 | tee "$LOGS/engine_bench_eager.log"
if [ "$MODEL" != tiny-random ]; then  # the 1B-class shape, built on the device machine (seeded, ~5 GB, no download)
  "$PY" -m pdserve.cli fetch --model llama-1b-random
  "$PY" -m pdserve.cli bench engine --model llama-1b-random --device cuda --dtype bfloat16 --batch-sizes 1,8,32,128 \
    --compare transformers 2>&1 | tee "$LOGS/engine_bench_1b.log"
fi

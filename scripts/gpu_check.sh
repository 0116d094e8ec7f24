#!/bin/bash
# The checks to run on a machine with a GPU, as one command: the CUDA tests (engine float32 on CUDA == CPU,
# decode in CUDA graphs == eager, bfloat16 on CUDA, llama-1b-random == transformers, a transfer of CUDA caches
# over gloo, the sampler and its seeded noise on CUDA), then the benches on CUDA: the transfer bench (gloo: NCCL
# needs two GPUs, one rank each) and, per model, the engine bench against transformers and once more with decode
# eager (--decode-graphs off) to show what the graphs buy, and the guided bench (constrained rows' step cost: the
# mask bias copied to the device).
# Models: llama-1b-random (built where it runs: seeded, ~5 GB, no download) gives the GPU figures;
# smollm2-135m joins where its converted folder is in the cache (it is too big to carry to a device machine,
# which cannot download it), tiny-random runs in the tests. PY picks the interpreter (a device machine brings
# its own torch). Logs land in $OUT when it is set. Every step runs; the exit status is the first failure's.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
LOGS=${OUT:-/tmp}
CACHE=${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}/models
export PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
models=llama-1b-random
filter="not smollm2"
if [ -f "$CACHE/smollm2-135m/model.safetensors" ]; then models="smollm2-135m $models"; filter=""; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
status=0
note() { local rc=$?; [ "$rc" -eq 0 ] || { echo "FAILED ($rc): $1" >&2; [ "$status" -ne 0 ] || status=$rc; }; }
"$PY" -m pdserve.cli fetch --model llama-1b-random; note "fetch"
"$PY" -m pytest -q -p no:cacheprovider -m cuda -k "$filter" tests/unit/engine/test_cuda_engine.py \
  tests/unit/transfer/test_device_caches.py tests/unit/engine/test_sampler.py tests/unit/engine/test_seeded_noise.py \
  2>&1 | tee "$LOGS/cuda_tests.log"; note "CUDA tests"
"$PY" -m pdserve.cli bench transfer --device cuda --backend gloo --repeats 5 2>&1 | tee "$LOGS/transfer_bench.log"
note "transfer bench"
for model in $models; do
  "$PY" -m pdserve.cli bench engine --model "$model" --device cuda --dtype bfloat16 --batch-sizes 1,8,32,128 \
    --compare transformers 2>&1 | tee "$LOGS/engine_bench_$model.log"; note "engine bench $model"
  "$PY" -m pdserve.cli bench engine --model "$model" --device cuda --dtype bfloat16 --batch-sizes 1,32 \
    --compare none --rounds 2 --decode-graphs off 2>&1 | tee "$LOGS/engine_bench_eager_$model.log"
  note "eager engine bench $model"
  "$PY" -m pdserve.cli bench guided --model "$model" --device cuda --dtype bfloat16 --batch 32 --constrained 8,32 \
    --rounds 2 2>&1 | tee "$LOGS/guided_bench_$model.log"; note "guided bench $model"
done
exit "$status"

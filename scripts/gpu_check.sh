#!/bin/bash
# The checks a session with a lent GPU runs, as one device call (see ../shared/PLATFORM-NOTES.md): the CUDA
# tests (engine float32 on CUDA == CPU, bfloat16 on CUDA, a transfer of CUDA caches over gloo), then the engine
# and transfer benches on CUDA. NCCL needs two GPUs (one rank per GPU), so the transfer bench forces gloo.
# PY picks the interpreter (the device machine brings its own torch); the model cache must hold smollm2-135m.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$PY" -m pytest -q -p no:cacheprovider -m cuda tests/unit
"$PY" -m pdserve.cli bench engine --model smollm2-135m --device cuda --dtype bfloat16 --batch-sizes 1,8,32,128 \
  --compare transformers
"$PY" -m pdserve.cli bench transfer --device cuda --backend gloo --repeats 5

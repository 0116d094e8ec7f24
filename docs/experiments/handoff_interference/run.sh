#!/usr/bin/env bash
# The ITL of 8 decoding streams (smollm2-135m, decode-only engine) with no new requests, with new requests' commands
# only, and with their KV hand-offs (1k/2k/4k-token prompts, one a second), alternately; then whether gloo's I/O
# thread blocks the GIL while a receive is in flight. From the repository root, its venv active; about 12 minutes.
#   a: 2 torch threads (a worker on this 2-core host), the sender competing for the cores (--sender-nice 0)
#   b: the same with 1 torch thread
#   c: 2 torch threads, the sender at nice 19 (as on a host of its own), a phase with the transfer threads at nice 10
set -euo pipefail
out=docs/experiments/handoff_interference
export PYTHONPATH=$PWD/src:$PWD
python "$out/interference.py" --rounds 6 --seconds 10 --sender-nice 0 --rows "$out/rows-a.json" \
  | tee "$out/results-a.txt"
python "$out/interference.py" --rounds 4 --seconds 8 --threads 1 --sender-nice 0 --rows "$out/rows-b.json" \
  | tee "$out/results-b.txt"
python "$out/interference.py" --rounds 4 --seconds 8 --rows "$out/rows-c.json" | tee "$out/results-c.txt"
python "$out/gil_probe.py" | tee "$out/results-gil.txt"

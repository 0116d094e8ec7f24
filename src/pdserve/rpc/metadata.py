"""gRPC metadata keys beside the messages: the public Generate API's (protos/pdserve/v1/generate.proto), and one
of the internal decode worker's Generate (worker.proto)."""

from __future__ import annotations

# Initial metadata of an admitted Generate stream: the router's predicted TTFT in milliseconds (an integer),
# sent before the first token so clients and `pdserve bench admission` can hold the predictor to account.
PREDICTED_TTFT_KEY = "x-pdserve-predicted-ttft-ms"

# Initial metadata of a decode worker's Generate stream, sent once it has reserved the KV blocks and called its
# prefill worker: a router whose first-token bound runs out after it blames the prefill side, before it the
# decode worker (stuck, or stopped, before it could hand off).
HANDOFF_STARTED_KEY = "x-pdserve-handoff-started"

# Trailing metadata of a decode worker's Generate stream that took a hand-off: how long the prompt waited on its
# prefill worker (milliseconds, an integer). Other routers' prompts ahead of it are invisible to this router, which
# takes the wait out of the TTFT its calibration learns from (services/router/calibration.py).
PREFILL_WAITED_KEY = "x-pdserve-prefill-waited-ms"

"""gRPC metadata keys beside the messages: the public Generate API's (protos/pdserve/v1/generate.proto), and those
of the internal decode worker's Generate (worker.proto)."""

from __future__ import annotations

# Initial metadata of an admitted Generate stream: the router's predicted TTFT in milliseconds (an integer),
# sent before the first token so clients and `pdserve bench admission` can hold the predictor to account.
PREDICTED_TTFT_KEY = "x-pdserve-predicted-ttft-ms"

# The request's id (its request_id, or the one the router gave it), in an admitted Generate stream's initial metadata
# and in every Generate call's trailing metadata once the router read the request: a refused or failed call carries no
# message to echo it in, and a caller that set none has only this to quote (as OpenAI's x-request-id header).
REQUEST_ID_KEY = "x-request-id"

# Initial metadata of a decode worker's Generate stream, sent once it has reserved the KV blocks and called its
# prefill worker: a router whose first-token bound runs out after it blames the prefill side, before it the
# decode worker (stuck, or stopped, before it could hand off).
HANDOFF_STARTED_KEY = "x-pdserve-handoff-started"

# Trailing metadata of a decode worker's Generate stream that took a hand-off: how long the prompt waited on its
# prefill worker (milliseconds, an integer). Other routers' prompts ahead of it are invisible to this router, which
# takes the wait out of the TTFT its calibration learns from (services/router/calibration.py).
PREFILL_WAITED_KEY = "x-pdserve-prefill-waited-ms"

# Trailing metadata of a decode (or colocated) worker's Generate stream that ended there: how many sequences its
# engine had freed once this one's KV blocks were (an integer, this one counted). A report of the worker's load that
# says as many (`WorkerState.sequences_freed`) was sampled with the blocks free, and a router counts them back as freed
# only against an earlier report (services/router/worker_frees.py).
SEQUENCES_FREED_KEY = "x-pdserve-sequences-freed"

"""gRPC metadata keys of the public Generate API, beside its messages (protos/pdserve/v1/generate.proto)."""

from __future__ import annotations

# Initial metadata of an admitted Generate stream: the router's predicted TTFT in milliseconds (an integer),
# sent before the first token so clients and `pdserve bench admission` can hold the predictor to account.
PREDICTED_TTFT_KEY = "x-pdserve-predicted-ttft-ms"

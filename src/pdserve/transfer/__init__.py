"""The KV data plane: moves one sequence's KV blocks from a prefill worker into a decode worker's cache.

Control (which blocks, which tag, where to rendezvous, the layout) travels over gRPC; only the bytes
move here, over a torch.distributed pair group per (prefill, decode) pair. `base.py` holds the
interfaces, `layout.py` what both sides must agree on, `torch_dist.py` the gloo/NCCL implementation,
built from `rendezvous.py` (how a pair meets), `pair_group.py` (its process groups), `wire.py` (header
and status), `pipeline.py` and `blocks.py` (the data messages), `send_pair.py` and `recv_pair.py`
(each side of one pair), `store_calls.py` (store calls a stopped peer cannot hold), `send_start.py` (when a send
begins reading the blocks: its caller may call it off until then), `threads.py` (the threads a worker's transfers
block in), `failures.py` (why one failed, as its metric counts it).
"""

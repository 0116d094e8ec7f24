"""Time to give a decoding sequence its next block in a large, fragmented pool (a GPU's cache holds 10^5 blocks).

The pool is filled with one-block sequences and every third is freed, so each live sequence's next block
belongs to its neighbour and the block manager must search for a fit.

    PYTHONPATH=src python docs/experiments/block_allocation/alloc_bench.py 100000
"""

from __future__ import annotations

import sys
import time

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from pdserve.protocol.sampling import SamplingParams


def main(num_blocks: int) -> None:
    blocks = BlockManager(num_blocks, 16, enable_prefix_caching=False)
    seqs = []
    while blocks.num_free_blocks:
        seq = Sequence(f"s{len(seqs)}", list(range(16)), SamplingParams(max_tokens=1000))
        assert blocks.allocate_slots(seq, 16)
        seq.num_computed_tokens = 16
        seqs.append(seq)
    for seq in seqs[::3]:
        blocks.free(seq)
    growing = seqs[1::3][:2000]
    start = time.perf_counter()
    for seq in growing:
        assert blocks.allocate_slots(seq, 16)
    print(f"{num_blocks} blocks: {(time.perf_counter() - start) / len(growing) * 1e6:.1f} us per new block")


if __name__ == "__main__":
    main(int(sys.argv[1]))

"""A CPU engine's large tensors reuse the process's heap rather than fresh pages from the kernel each step.

glibc's malloc serves an allocation above its mmap threshold (32 MiB at most by default) with pages of its own,
returned to the kernel when freed: each step's next one page-faults them in again. A decode step's attention
gathers every sequence's K/V per layer; with long contexts those tensors pass the threshold, and on a 2-core host
eight sequences of 6000 tokens took 1.4-3.1 s of attention a step against 0.52-1.16 s with the threshold raised
(2.4-3.3x over four runs; docs/experiments/decode_context/heap_bench.py). Memory freed at the heap's top went
back to the kernel too, so a whole decode step of eight 2048-token sequences took ~1 s against 0.37 s with both
kept (one thread). Freed memory stays in the heap for the next step: a worker's resident memory is what its
largest step needed.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h): above the first, an allocation gets pages of its own; free memory past the
# second at the heap's top goes back to the kernel (and the next step faults it in again).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
THRESHOLD_BYTES = 1 << 30  # no step's tensor is larger: everything comes from the heap, and stays there


def keep_large_allocations_in_heap() -> bool:
    """Raises glibc's mmap and trim thresholds for this process; False where the C library has no `mallopt`
    (musl, macOS) or refuses it, which costs only the speed above."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    if mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) != 1 or mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES) != 1:
        log.warning("mallopt refused: a CPU engine's long-context steps page-fault their tensors each step")
        return False
    return True

"""A CPU engine's large tensors reuse the process's heap rather than fresh pages from the kernel each step.

glibc's malloc serves an allocation above its mmap threshold (32 MiB at most by default) with pages of its own,
returned to the kernel when freed: each step's next one page-faults them in again. A decode step's attention
gathers every sequence's K/V per layer; with long contexts those tensors pass the threshold, and on a 2-core host
eight sequences of 6000 tokens took 1.7-3.1 s of attention a step against 0.52-1.16 s with the threshold raised
(2.7-3.3x, two runs on a host other jobs shared; docs/experiments/decode_context/heap_bench.py). Freed memory
stays in the heap for the next step: a worker's resident memory is what its largest step needed.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
THRESHOLD_BYTES = 1 << 30  # no step's tensor is larger: everything comes from the heap


def keep_large_allocations_in_heap() -> bool:
    """Raises glibc's mmap threshold for this process; False where the C library has no `mallopt` (musl,
    macOS) or refuses it, which costs only the speed above."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    if mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD) refused: a CPU engine's long-context steps page-fault their tensors")
        return False
    return True

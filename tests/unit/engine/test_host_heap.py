"""A CPU engine raises glibc's mmap and trim thresholds (host_heap.py): a large allocation then comes from the heap,
not from pages mapped for it, and stays there once freed (a long-context decode step's K/V gather, page-faulted in
each step)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]  # the probe imports tests.unit.engine

PROBE = """
import ctypes, sys
from pdserve.engine.host_heap import keep_large_allocations_in_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
if sys.argv[1] == "raised":
    assert keep_large_allocations_in_heap()
elif sys.argv[1] == "engine":
    from tests.unit.engine.engine_harness import make_engine
    make_engine(num_kv_blocks=16)
block = libc.malloc(64 << 20)
where = "mapped" if libc.mallinfo2().hblkhd >= 64 << 20 else "heap"
libc.free(ctypes.c_void_p(block))
print(where, "kept" if libc.mallinfo2().keepcost >= 32 << 20 else "returned")
"""


def _where(side: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE, side], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_large_allocation_comes_from_the_heap_once_the_threshold_is_raised() -> None:
    import ctypes

    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("not glibc 2.33 or later: no mallinfo2 to look with")
    assert _where("default") == "mapped returned"
    assert _where("raised") == "heap kept"  # freed, it stays for the next step's tensors
    assert _where("engine") == "heap kept"  # a CPU engine's model runner raises it in its own process

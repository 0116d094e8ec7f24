"""On PYTHONPATH, this runs some processes as if on a host of their own whose clocks are not this machine's: their
wall clock PDSERVE_TEST_CLOCK_SKEW_S seconds off, and their monotonic clock a day on (each host's counts from its own
boot). Those are the processes whose script is named PDSERVE_TEST_SKEWED_SCRIPT (by default Ray's worker processes,
a cluster's worker actors). It shifts Python's clock functions themselves, below any pdserve code, as such a host
would; every other process (the router of a `pdserve up`, the test) keeps the machine's clocks."""

from __future__ import annotations

import os
import sys
import time

SKEW_S = float(os.environ.get("PDSERVE_TEST_CLOCK_SKEW_S", "0"))
SCRIPT = os.environ.get("PDSERVE_TEST_SKEWED_SCRIPT", "default_worker.py")
MONOTONIC_SKEW_S = 86400.0

if SKEW_S and sys.argv and os.path.basename(sys.argv[0]) == SCRIPT:
    _time, _time_ns, _monotonic, _monotonic_ns = time.time, time.time_ns, time.monotonic, time.monotonic_ns
    time.time = lambda: _time() + SKEW_S
    time.time_ns = lambda: _time_ns() + round(SKEW_S * 1e9)
    time.monotonic = lambda: _monotonic() + MONOTONIC_SKEW_S
    time.monotonic_ns = lambda: _monotonic_ns() + round(MONOTONIC_SKEW_S * 1e9)

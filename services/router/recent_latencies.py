"""The router's recent TTFT and TPOT per worker, for `pdserve status`: a window of samples, not a metric (those
are exported as histograms, metrics.py)."""

from __future__ import annotations

import math
import threading
from collections import deque


class RecentLatencies:
    """The last `size` TTFT and TPOT samples per worker, for `pdserve status` (p50, p99)."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._samples: dict[tuple[str, str], deque[float]] = {}
        self._lock = threading.Lock()

    def add(self, worker_id: str, kind: str, seconds: float) -> None:
        with self._lock:
            self._samples.setdefault((worker_id, kind), deque(maxlen=self.size)).append(seconds)

    def quantiles(self, worker_id: str, kind: str) -> tuple[float, float] | None:
        """(p50, p99) in seconds; None without samples (0 would read as the best latency of all)."""
        with self._lock:
            values = sorted(self._samples.get((worker_id, kind), ()))
        if not values:
            return None
        return _pick(values, 0.5), _pick(values, 0.99)

    def worker_ids(self) -> set[str]:
        with self._lock:
            return {worker_id for worker_id, _ in self._samples}

    def forget(self, worker_id: str) -> bool:
        with self._lock:
            for key in [key for key in self._samples if key[0] == worker_id]:
                del self._samples[key]
        return True


def _pick(values: list[float], q: float) -> float:
    """The nearest-rank quantile of sorted `values`: the smallest with at least a `q` share at or below it."""
    return values[max(0, math.ceil(q * len(values)) - 1)]

"""The router's correction of its TTFT predictions under load, per prefill worker, from requests that did not run
alone.

calibration.py corrects a prediction from requests that ran alone, so it never sees what load does beyond the queue
the profiles price: measured on a shared host, a prompt that computed beside another prompt took 1.2-1.7x its own
cost as predicted, one computed alone while the decode worker was busy 1.0-1.5x, and the prefill queue the prompts
waited in was short (docs/experiments/ttft_prediction/). A request shares steps and cores with the work ahead of it
for at most as long as that work lasts, so a factor k scales the queueing q ahead of it (a prefill queue, a decode
worker's step) and as much of its own cost as q is long: q and min(own, q) are predicted to take k times as long.
From each request placed behind queueing that did not run alone, its measured TTFT less the rest of its own cost
and its q + min(own, q) are kept as moving averages; their ratio is k. A ratio of averages, so a request behind a
short queue moves k as little as it weighs. What k adds counts as queueing and vanishes with the queue: a request
placed with none is predicted as before, so only the load can make a shed request's retry succeed.
"""

from __future__ import annotations

MIN_FACTOR, MAX_FACTOR = 0.25, 4.0


class LoadCalibration:
    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self._measured_s: dict[str, float] = {}
        self._predicted_s: dict[str, float] = {}

    def factor(self, worker_id: str) -> float:
        predicted = self._predicted_s.get(worker_id)
        if not predicted:
            return 1.0
        return min(max(self._measured_s[worker_id] / predicted, MIN_FACTOR), MAX_FACTOR)

    def observe(self, worker_id: str, own_s: float, queue_s: float, measured_s: float) -> None:
        """A loaded request placed with own cost `own_s` behind `queue_s` of queueing (as the profiles price them)
        whose TTFT was `measured_s`. A first observation moves the factor from 1 as any later one does."""
        if queue_s <= 0 or measured_s <= 0:
            return
        shared_s = queue_s + min(own_s, queue_s)
        predicted = self._predicted_s.get(worker_id, shared_s)
        measured = self._measured_s.get(worker_id, shared_s)
        self._predicted_s[worker_id] = predicted + self.alpha * (shared_s - predicted)
        self._measured_s[worker_id] = measured + self.alpha * (measured_s - own_s + min(own_s, queue_s) - measured)

    def queueing_s(self, worker_id: str, own_s: float, queue_s: float) -> float:
        """The queueing a request placed with own cost `own_s` behind `queue_s` of queueing is predicted to wait:
        k * (queue_s + min(own_s, queue_s)) - min(own_s, queue_s), so none without queueing."""
        overlap_s = min(own_s, queue_s)
        return max(0.0, self.factor(worker_id) * (queue_s + overlap_s) - overlap_s)

    def worker_ids(self) -> set[str]:
        return set(self._predicted_s)

    def forget(self, worker_id: str) -> bool:
        self._predicted_s.pop(worker_id, None)
        self._measured_s.pop(worker_id, None)
        return True

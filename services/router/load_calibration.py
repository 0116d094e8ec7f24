"""The router's correction of its TTFT predictions under load, per prefill worker, from requests that did not run
alone.

calibration.py corrects a prediction from requests that ran alone, so it never sees what load does beyond the queue
the profile prices: measured on a shared host, a prompt placed beside others computed 1.3-1.6x slower than alone
(the busy decode worker and the prompts batched with it share the cores and steps), and a queue priced prompt by
prompt is not what a batched queue costs (docs/experiments/ttft_prediction/). From each request placed behind
queueing (a prefill queue, a decode worker's step) that did not run alone, this keeps its measured TTFT and its
prediction before this factor, each as a moving average: their ratio scales such predictions. A ratio of averages,
so a long prediction weighs as much as it is long. What it adds counts as queueing, and a request placed with no
queueing is predicted as before, so only the load can make a shed request's retry succeed.
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

    def observe(self, worker_id: str, predicted_s: float, measured_s: float) -> None:
        """`predicted_s`: a loaded request's TTFT as predicted before this factor. A first observation moves the
        factor from 1 as any later one does."""
        if predicted_s <= 0 or measured_s <= 0:
            return
        predicted = self._predicted_s.get(worker_id, predicted_s)
        measured = self._measured_s.get(worker_id, predicted_s)
        self._predicted_s[worker_id] = predicted + self.alpha * (predicted_s - predicted)
        self._measured_s[worker_id] = measured + self.alpha * (measured_s - measured)

    def queueing_s(self, worker_id: str, own_s: float, queue_s: float) -> float:
        """The queueing a request placed with own cost `own_s` behind `queue_s` of queueing (as the profile prices
        it) is predicted to wait: what the factor adds to the whole, none without queueing."""
        if queue_s <= 0:
            return 0.0
        return max(0.0, self.factor(worker_id) * (own_s + queue_s) - own_s)

    def worker_ids(self) -> set[str]:
        return set(self._predicted_s)

    def forget(self, worker_id: str) -> bool:
        self._predicted_s.pop(worker_id, None)
        self._measured_s.pop(worker_id, None)
        return True

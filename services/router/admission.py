"""Admission control: admit a request only when its placement is predicted to meet its SLO, else shed at once.

Shedding early, with a retry hint, lets a client go to another replica while there is still time,
instead of waiting in a queue that cannot serve it in time. Every check is arithmetic on the router's
cached view: no I/O, sub-millisecond.
"""

from __future__ import annotations

from pdserve.config import RouterConfig
from pdserve.errors import OverloadedError
from services.router.placement import Placement
from services.router.predictor import Predictor

MIN_RETRY_MS, MAX_RETRY_MS = 100, 30_000


class Admission:
    def __init__(self, config: RouterConfig, predictor: Predictor) -> None:
        self.config = config
        self.predictor = predictor
        self.in_flight = 0

    def check(self, placement: Placement, prompt_tokens: int, priority: int, slo_s: tuple[float, float]) -> None:
        """Raises OverloadedError saying why, with a retry hint in milliseconds. `slo_s`: (TTFT, TPOT)."""
        ttft_slo_s, tpot_slo_s = slo_s
        if self.in_flight >= self.config.max_in_flight:
            raise OverloadedError(f"router has {self.in_flight} requests in flight (limit {self.config.max_in_flight})")
        prefill = placement.prefill_worker
        queued = self.predictor.queued_tokens(prefill)
        bound = self.config.queue_bound(priority)
        if queued + prompt_tokens > bound:
            raise OverloadedError(
                f"prefill queue full: {queued} + {prompt_tokens} tokens > {bound:.0f} at priority {priority}",
                _retry_ms(self.predictor.queue_s(prefill)),
            )
        if placement.predicted_ttft_s > ttft_slo_s:
            late = placement.predicted_ttft_s - ttft_slo_s
            raise OverloadedError(
                f"predicted TTFT {placement.predicted_ttft_s * 1e3:.0f} ms exceeds the SLO of "
                f"{ttft_slo_s * 1e3:.0f} ms on the best prefill worker",
                _retry_ms(late),
            )
        if self.predictor.free_blocks(placement.decode) < placement.blocks_needed:
            raise OverloadedError(
                f"no decode worker has {placement.blocks_needed} free KV blocks",
                _retry_ms(placement.predicted_tpot_s * 32),
            )
        if placement.predicted_tpot_s > tpot_slo_s:
            raise OverloadedError(
                f"predicted TPOT {placement.predicted_tpot_s * 1e3:.1f} ms exceeds the SLO of "
                f"{tpot_slo_s * 1e3:.1f} ms on every decode worker",
                _retry_ms(placement.predicted_tpot_s * 64),
            )


def _retry_ms(seconds: float) -> int:
    return int(min(max(seconds * 1e3, MIN_RETRY_MS), MAX_RETRY_MS))

"""The router's admission of a prompt as the simulator applies it: the router's own rules
(`protocol/admission_rules.py`) on the simulator's state, so a plan above a split's capacity sheds what the
cluster would, instead of queueing every request until all miss their SLO. The decode side's checks (free KV
blocks, predicted TPOT) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import RouterConfig
from pdserve.protocol.admission_rules import queue_full, queue_room_s, ttft_budget_s


@dataclass(frozen=True)
class AdmissionModel:
    """A router whose default TTFT SLO is `ttft_s` (what a plan's requests, setting none, are held to), with its
    `slo_headroom`, its queue bound at priority 0 (`max_queued_prefill_tokens`' share), its first-token bound and
    the KV transfer speed its TTFT predictions assume (`transfer_gbps`: configured, not the profile's measured
    one, so a prompt's predicted hand-off is the router's, which is what it sheds on)."""

    ttft_s: float
    headroom: float = RouterConfig.slo_headroom
    queue_bound_tokens: float = RouterConfig().queue_bound(0)
    first_token_s: float = RouterConfig.first_token_timeout_s
    transfer_gbps: float = RouterConfig.transfer_gbps

    def sheds(self, queued_tokens: int, queued_s: float, prompt_tokens: int, own_s: float) -> bool:
        """Whether a prompt of `prompt_tokens` whose own TTFT is `own_s` is shed by a prefill worker holding
        `queued_tokens` placed and without a first token yet, predicted to take `queued_s`: the queue bound, then the
        predicted wait against the room the (default, so never below its own cost) SLO leaves."""
        if queue_full(queued_tokens, prompt_tokens, self.queue_bound_tokens):
            return True
        budget = ttft_budget_s(self.ttft_s, own_s, explicit=False, first_token_s=self.first_token_s)
        room = queue_room_s(budget, own_s, self.headroom)
        return queued_s > room

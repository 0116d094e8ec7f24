"""The arithmetic of admitting a prompt on a prefill worker's predicted queue: one definition for the router
(services/router/admission.py), which sheds by it, and the planner's simulation of that router
(planner/admission_model.py), which must shed exactly as it does."""

from __future__ import annotations


def queue_full(queued_tokens: int, prompt_tokens: int, bound: float) -> bool:
    """Whether the prompt overflows the queue's token bound. An empty queue takes any prompt, whatever its size:
    an idle cluster serves every valid request."""
    return bool(queued_tokens) and queued_tokens + prompt_tokens > bound


# Of the default TTFT SLO, what a request that sets none may always queue beyond its own cost. Without it a prompt
# whose own prefill reaches the default was left no queueing at all: shed behind any work ahead (one decoding
# stream's step) for as long as the cluster stayed busy, its retry hint never coming true (a fault review).
MIN_QUEUE_SHARE = 0.1


def ttft_budget_s(slo_s: float, own_s: float, explicit: bool, first_token_s: float) -> float:
    """The TTFT a request is held to: its own SLO, or the server's default but never less than its own cost plus
    `MIN_QUEUE_SHARE` of that default; and never past the router's first-token bound, where it would be cancelled
    (and its prefill worker blamed)."""
    return min(slo_s if explicit else max(slo_s, own_s + MIN_QUEUE_SHARE * slo_s), first_token_s)


def queue_room_s(budget_s: float, own_s: float, headroom: float) -> float:
    """How long the predicted queue ahead may take: the headroom's share of what the budget leaves beyond the
    request's own cost (the margin applies only to the queueing part, the part the prediction knows least)."""
    return headroom * (budget_s - own_s)

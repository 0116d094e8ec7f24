"""Admission control: admit a request only when its placement is predicted to meet its SLO, else answer at once.

A prediction splits into the request's own isolated cost and what the current queues add (predictor.py).
What the own cost alone rules out is the request's fault and no retry helps: INVALID_ARGUMENT naming the
SLO field and the smallest value the cluster offers, or the KV blocks it needs beyond any worker's total.
What the queues rule out is shed with RESOURCE_EXHAUSTED and a retry hint estimating when it would fit,
so a client can go elsewhere while there is still time; so is a tenant over its share of a nearly full
cluster, which leaves the last `fair_share_reserve` of the room to tenants below theirs (tenant_shares.py), and a
request below a priority class being served, which leaves it the last `low_priority_reserve` (priority_classes.py).
A request that set no SLO gets the default, but
never less than its own cost: an idle cluster serves every valid one. The safety margin (slo_headroom)
applies only to the queueing part, which is the part the predictor knows least. Every check is
arithmetic on the router's cached view: no I/O, sub-millisecond.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.config import RouterConfig
from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.protocol.admission_rules import queue_full, queue_room_s, ttft_budget_s
from pdserve.security.api_keys import OPEN_TENANT
from pdserve.security.quotas import Choices
from services.router.placement import Placement
from services.router.predictor import Predictor
from services.router.priority_classes import PriorityClasses
from services.router.retry_pacing import RetryPacing
from services.router.tenant_shares import TenantShares

MIN_RETRY_MS, MAX_RETRY_MS = 100, 30_000


class DeadlineTooShortError(TimeoutError):
    """The caller's deadline ends before the request's predicted first token: DEADLINE_EXCEEDED (HTTP 504) at once,
    counted `deadline_exceeded`, rather than a prefill the caller will not wait for (a review watched a 1500-token
    prompt with a 50 ms deadline compute for 2.1 s after its caller had gone). `by_load`: its own cost alone fit,
    the queue did not: demand the cluster could not take, as a shed is."""

    def __init__(self, message: str, by_load: bool) -> None:
        super().__init__(message)
        self.by_load = by_load


@dataclass(frozen=True)
class SLOTarget:
    """The SLO a request is held to, in seconds; `explicit`: the request set it, not the server's default."""

    ttft_s: float
    tpot_s: float
    ttft_explicit: bool = True
    tpot_explicit: bool = True


class Admission:
    def __init__(self, config: RouterConfig, predictor: Predictor, weights: Mapping[str, float] | None = None) -> None:
        """`weights`: the key file's tenant weights in the fair share (absent: 1 each)."""
        self.config = config
        self.predictor = predictor
        self.in_flight = 0
        self.shares = TenantShares()
        self.shares.weights = weights or {}
        self.classes = PriorityClasses()
        self.pacing = RetryPacing()

    def entered(self, tenant: str, priority: int) -> None:
        self.in_flight += 1
        self.shares.entered(tenant)
        self.classes.entered(priority)

    def left(self, tenant: str, priority: int) -> None:
        self.in_flight -= 1
        self.shares.left(tenant)
        self.classes.left(priority)

    def check_feasible(
        self, placement: Placement, prompt_tokens: int, slo: SLOTarget, choices: Choices | None = None
    ) -> None:
        """InvalidRequestError, naming the field, when no idle cluster could serve the request as asked: judged
        before anything that would shed it, whose retry hint would only lead here. `choices`: the request is the
        first of so many streamed at once (the HTTP API's n, for each prompt of a batch), which must all be in flight
        together."""
        self._check_own_cost(placement, prompt_tokens, slo)
        if choices is None:
            return
        if choices.n > self.config.max_in_flight:
            raise InvalidRequestError(
                choices.param,
                f"{choices} are {choices.n} requests in flight; the router allows {self.config.max_in_flight}",
            )
        if choices.n > placement.offer.held_at_once:
            first = ", the first prompt's" if choices.prompts > 1 else ""
            raise InvalidRequestError(
                choices.param,
                f"{choices} of up to {placement.blocks_needed} KV blocks each (prompt plus max_tokens, as every "
                f"request is judged{first}) are streamed at once; the decode workers hold "
                f"{placement.offer.held_at_once} such requests together (their KV and batch caps)",
            )

    def check_load(
        self,
        placement: Placement,
        prompt_tokens: int,
        priority: int,
        slo: SLOTarget,
        left_s: float | None = None,
        tenant: str | None = OPEN_TENANT,
    ) -> None:
        """OverloadedError, with a retry hint in milliseconds, when the current load cannot serve the request, or
        could only with the room kept for tenants below their share; DeadlineTooShortError when it could, but not
        within the caller's time left (`left_s`; None: no deadline). `tenant` None: a later choice of a request
        (the HTTP API's n) whose first was admitted, its tenant's share judged then: refused now, it would end
        the choices already streaming."""
        if tenant is not None:
            self.shares.asked(tenant)
            self.classes.asked(priority)
        try:
            self._check_room(placement, prompt_tokens, priority, slo, tenant, left_s)
        except OverloadedError as e:
            if e.reason != "kv":  # paced where its KV claim is judged (_check_kv_room)
                e.retry_after_ms = self.pacing.hint_ms(e.retry_after_ms, MAX_RETRY_MS, left_s=left_s)
            raise
        _check_deadline(placement, left_s)
        self.predictor.claims.admitted(placement.blocks_needed)
        self.pacing.admitted()

    def _check_room(
        self,
        placement: Placement,
        prompt_tokens: int,
        priority: int,
        slo: SLOTarget,
        tenant: str | None,
        left_s: float | None,
    ) -> None:
        """OverloadedError, with admission's own retry hint, when the load leaves the request no room."""
        if self.in_flight >= self.config.max_in_flight:
            limit = self.config.max_in_flight
            raise OverloadedError(f"router has {self.in_flight} requests in flight (limit {limit})", reason="in_flight")
        self._check_queue_bound(placement, prompt_tokens - placement.cached_tokens, priority)
        self._check_ttft(placement, slo)
        self._check_kv_room(placement, slo, left_s)
        # A stream waiting to move (its decode worker lost) has the next free place (lifecycle.py).
        if not self.predictor.has_batch_room(placement.decode, spare=self.predictor.tracker.held_for_moving):
            raise OverloadedError(
                f"no decode worker has room in its batch now (max_num_seqs {placement.decode.max_num_seqs})",
                _retry_ms(_batch_turn_s(placement)),
                reason="batch",
            )
        self._check_tpot(placement, slo)
        if tenant is not None:
            self._check_priority_reserve(placement, priority, slo)
            self._check_fair_share(placement, prompt_tokens - placement.cached_tokens, priority, slo, tenant)

    def _check_priority_reserve(self, placement: Placement, priority: int, slo: SLOTarget) -> None:
        """While a class above the request's is active (priority_classes.py), it leaves that class the last
        `priority_reserve` of its decode worker's batch places and KV blocks and of its prefill worker's TTFT queue
        room (its queue bound has the reserve already)."""
        reserve = self.config.priority_reserve(priority)
        if reserve <= 0 or not self.classes.higher_active(priority):
            return
        kept = self._kept_room(placement, reserve, slo, None)
        if kept is not None:
            what, retry_s = kept
            raise OverloadedError(
                f"requests of a priority above {priority} are being served, and the last {what} are kept for them "
                f"(low_priority_reserve {self.config.low_priority_reserve:g})",
                _retry_ms(retry_s),
                reason="priority",
            )

    def _check_fair_share(
        self, placement: Placement, new_tokens: int, priority: int, slo: SLOTarget, tenant: str
    ) -> None:
        """A tenant over its share (tenant_shares.py) leaves the last `fair_share_reserve` of each resource the
        request passed on (its decode worker's batch places and KV blocks, its prefill worker's queue) to tenants
        below theirs."""
        reserve = self.config.fair_share_reserve
        over = self.shares.over_share(tenant) if reserve > 0 else None
        if over is None:
            return
        queued = self.predictor.queued_tokens(placement.prefill_worker), new_tokens
        kept = self._kept_room(placement, reserve, slo, (*queued, self.config.queue_bound(priority) * (1 - reserve)))
        if kept is not None:
            what, retry_s = kept
            raise OverloadedError(
                f"tenant {tenant!r} holds {over.held} of the {over.total} streams in flight here, more than its "
                f"share among the {over.active} tenants active, and the last {what} are kept for tenants below their "
                f"share (fair_share_reserve {reserve:g})",
                _retry_ms(retry_s),
                reason="fair_share",
            )

    def _kept_room(
        self, placement: Placement, reserve: float, slo: SLOTarget, queue: tuple[int, int, float] | None
    ) -> tuple[str, float] | None:
        """Which room the request, having passed every other check, would take from the last `reserve` of: its
        decode worker's batch places or KV blocks, or its prefill worker's TTFT queue room or (`queue`: tokens
        queued, the request's new tokens, the bound less the reserve) queue bound; with a retry hint in seconds.
        None: it fits short of them all. What is kept leaves room for the request on an idle worker (a place, its
        blocks): a reserve that refused it there would refuse it for as long as the class it is kept for asks."""
        decode, blocks = placement.decode, placement.blocks_needed
        places = min(math.ceil(reserve * decode.max_num_seqs), max(decode.max_num_seqs - 1, 0))
        kept_blocks = min(math.ceil(reserve * decode.kv_blocks_total), max(decode.kv_blocks_total - blocks, 0))
        if not self.predictor.has_batch_room(decode, spare=self.predictor.tracker.held_for_moving + places):
            return f"{places} batch places of its decode worker", _batch_turn_s(placement)
        if self.predictor.free_blocks_for(decode, blocks) - kept_blocks < blocks:
            return f"{kept_blocks} KV blocks of its decode worker", _batch_turn_s(placement)
        room = self._ttft_room_s(placement, slo)[1]
        if placement.queue_s > room * (1 - reserve) or (queue is not None and queue_full(*queue)):
            return f"{reserve:.0%} of its prefill worker's queue room", placement.queue_s * reserve
        return None

    def _check_kv_room(self, placement: Placement, slo: SLOTarget, left_s: float | None) -> None:
        """Refused for room past its TTFT SLO, a request claims its blocks on the worker (kv_claims.py), unless one
        refused before it holds the worker's claim."""
        decode, blocks = placement.decode, placement.blocks_needed
        free = self.predictor.free_blocks(decode)
        if free - self.predictor.claims.held_from(decode.worker_id, blocks) >= blocks:
            return
        own_ms = _retry_ms(_batch_turn_s(placement))
        claims = self.predictor.claims
        claimable = self.config.kv_claims and decode.kv_blocks_total >= blocks  # else one would shut smaller ones out
        # The one request a claim calls back comes at its own hint, to the blocks kept for it; the others are paced.
        called = claimable and claims.claim(decode.worker_id, blocks, own_ms / 1e3, slo.ttft_s)
        retry_ms = self.pacing.hint_ms(own_ms, MAX_RETRY_MS, ahead=called, left_s=left_s)
        if claimable and not called:
            claims.expect(blocks, retry_ms / 1e3)
        if free >= blocks:
            raise OverloadedError(
                f"no decode worker has {blocks} free KV blocks now that an earlier, larger request did not get",
                retry_ms,
                reason="kv",
            )
        raise OverloadedError(f"no decode worker has {blocks} free KV blocks now", retry_ms, reason="kv")

    def _check_own_cost(self, placement: Placement, prompt_tokens: int, slo: SLOTarget) -> None:
        offer = placement.offer
        if placement.blocks_needed > offer.kv_blocks:
            if -(-prompt_tokens // placement.decode.block_size) > offer.kv_blocks:  # no max_tokens would fit
                field, what = "prompt", f"the prompt ({prompt_tokens} tokens) alone needs"
            else:
                field, what = "sampling.max_tokens", f"the prompt ({prompt_tokens} tokens) plus max_tokens need"
            raise InvalidRequestError(
                field, f"{what} {placement.blocks_needed} KV blocks; the largest worker has {offer.kv_blocks} in total"
            )
        if slo.ttft_explicit and offer.ttft_s > slo.ttft_s:
            raise InvalidRequestError(
                "slo.ttft_ms",
                f"{slo.ttft_s * 1e3:g} ms is below this {prompt_tokens}-token prompt's TTFT on an idle worker; "
                f"the smallest this cluster can offer is {math.ceil(max(offer.ttft_s, offer.ttft_now_s) * 1e3)} ms",
            )
        if offer.ttft_s > self.config.first_token_timeout_s:
            raise InvalidRequestError(
                "prompt",
                f"this {prompt_tokens}-token prompt's TTFT on an idle worker, {math.ceil(offer.ttft_s * 1e3)} ms, is "
                f"past the router's first-token bound of {self.config.first_token_timeout_s * 1e3:g} ms",
            )
        if slo.tpot_explicit and offer.tpot_s > slo.tpot_s:
            raise InvalidRequestError(
                "slo.tpot_ms",
                f"{slo.tpot_s * 1e3:g} ms is below one decode step of this request's context "
                f"({placement.own_context_tokens} tokens on average) on an idle worker; "
                f"the smallest this cluster can offer is {math.ceil(max(offer.tpot_s, offer.tpot_now_s) * 1e3)} ms",
            )

    def _check_queue_bound(self, placement: Placement, new_tokens: int, priority: int) -> None:
        """`new_tokens`: what the prompt adds to the queue, the part its prefill worker's cache does not hold."""
        prefill = placement.prefill_worker
        queued = self.predictor.queued_tokens(prefill)
        bound = self.config.queue_bound(priority)
        if queue_full(queued, new_tokens, bound):
            # It fits once the overflow has drained (all of the queue, for a prompt past the bound on its own).
            overflow = min(queued + new_tokens - bound, queued) / queued
            raise OverloadedError(
                f"prefill queue full: {queued} + {new_tokens} tokens > {bound:.0f} at priority {priority}",
                _retry_ms(self.predictor.queue_s(prefill) * overflow),
                reason="queue",
            )

    def _check_ttft(self, placement: Placement, slo: SLOTarget) -> None:
        """Also within the first-token bound, whatever the SLO: the router would cancel a request still waiting
        there, and blame (eject) its busy but healthy prefill worker."""
        own = placement.own_ttft_s
        budget, room = self._ttft_room_s(placement, slo)
        if placement.queue_s > room:
            bound = "router's first-token bound" if budget == self.config.first_token_timeout_s else "SLO"
            # The headroom sheds before the prediction reaches the bound: the message names the queue's share.
            why = (
                f"its {placement.queue_s * 1e3:.0f} ms queued is past the {room * 1e3:.0f} ms of queueing that the "
                f"{bound} of {budget * 1e3:.0f} ms leaves beyond this prompt's own {own * 1e3:.0f} ms "
                f"(slo_headroom {self.config.slo_headroom:g})"
                if room >= 0  # else its own cost, at the worker's speed now (slowed), is past an explicit SLO alone
                else f"this prompt's own {own * 1e3:.0f} ms at its current speed leaves no room for queueing "
                f"within the {bound} of {budget * 1e3:.0f} ms"
            )
            raise OverloadedError(
                f"predicted TTFT {placement.predicted_ttft_s * 1e3:.0f} ms on the best prefill worker: {why}",
                _retry_ms(placement.queue_s - room),
                reason="ttft",
            )

    def _ttft_room_s(self, placement: Placement, slo: SLOTarget) -> tuple[float, float]:
        """The TTFT the request is held to (its SLO, within the router's first-token bound) and the queueing that
        leaves beyond the prompt's own cost, less the headroom."""
        own = placement.own_ttft_s
        budget = ttft_budget_s(slo.ttft_s, own, slo.ttft_explicit, self.config.first_token_timeout_s)
        return budget, queue_room_s(budget, own, self.config.slo_headroom)

    def _check_tpot(self, placement: Placement, slo: SLOTarget) -> None:
        idle = self.predictor.idle_tpot_s(placement.decode, placement.own_context_tokens)
        budget = slo.tpot_s if slo.tpot_explicit else max(slo.tpot_s, idle)
        room = self.config.slo_headroom * (budget - idle)
        if placement.predicted_tpot_s - idle > room:
            why = (
                f"its batch adds {(placement.predicted_tpot_s - idle) * 1e3:.1f} ms to an idle step's "
                f"{idle * 1e3:.1f} ms, past the {room * 1e3:.1f} ms that the SLO of {budget * 1e3:.1f} ms leaves "
                f"(slo_headroom {self.config.slo_headroom:g})"
                if room >= 0
                else f"an idle step's {idle * 1e3:.1f} ms at its current speed leaves no room within the SLO of "
                f"{budget * 1e3:.1f} ms"
            )
            raise OverloadedError(
                f"predicted TPOT {placement.predicted_tpot_s * 1e3:.1f} ms on the decode worker placed: {why}",
                _retry_ms(placement.predicted_tpot_s * 64),
                reason="tpot",
            )


def _check_deadline(placement: Placement, left_s: float | None) -> None:
    """Judged after the load's checks: a request the load sheds gets its retry hint (and counts as demand turned
    away) whatever its deadline. The queue included: the caller would get DEADLINE_EXCEEDED anyway, only later and
    at the cluster's cost."""
    if left_s is None or placement.predicted_ttft_s <= left_s:
        return
    queued = f", {placement.queue_s * 1e3:.0f} ms of it queued" if placement.queue_s > 0 else ""
    raise DeadlineTooShortError(
        f"the first token is predicted in {placement.predicted_ttft_s * 1e3:.0f} ms{queued}, past the caller's "
        f"deadline ({max(left_s, 0.0) * 1e3:.0f} ms left): not started; a longer deadline would be served",
        by_load=placement.own_ttft_s <= left_s,
    )


def _batch_turn_s(placement: Placement) -> float:
    """The retry hint for a decode worker's batch or KV room: 32 of its steps, a guess at when a stream of a full
    batch has ended."""
    return placement.predicted_tpot_s * 32


def _retry_ms(seconds: float) -> int:
    return int(min(max(seconds * 1e3, MIN_RETRY_MS), MAX_RETRY_MS))

"""Placements that wait rather than fail at once: a new request's for a role's first live worker, a moved
request's for a worker that did not fail it (or a restart), a migrating stream's for a decode worker with room.
The request lifecycle (lifecycle.py) asks them; each wait stays within the caller's deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress
from functools import partial

from pdserve.config import RouterConfig
from pdserve.errors import OverloadedError
from pdserve.protocol.compatibility import needed_features
from pdserve.protocol.roles import Role
from services.router.load_tracker import LoadTracker
from services.router.placement import NoWorkersError, Placement, PlacementPolicy, UnpairedError
from services.router.request import RoutedRequest
from services.router.retry import FailedWorkers, Moves

NO_WORKERS_POLL_S = 0.1


class PlacementWaits:
    """A router's placements that wait. What a wait spends is its request's (`FailedWorkers.waited_s`, `Moves`); the
    streams waiting for room are counted in the load tracker, which admission reads."""

    def __init__(self, placement: PlacementPolicy, config: RouterConfig, tracker: LoadTracker) -> None:
        self.placement = placement
        self.config = config
        self.tracker = tracker  # its `moving`: the streams waiting for a place, which admission leaves them

    def args(self, req: RoutedRequest) -> tuple[list[int], int, float, frozenset[str]]:
        """What `PlacementPolicy.place` is asked of the request before the workers it avoids: its prompt, max_tokens,
        TPOT SLO (its priority's where it set none) and the worker features it needs."""
        _, tpot_ms = self.config.slo_for(req.priority, req.ttft_slo_ms, req.tpot_slo_ms)
        return req.prompt_token_ids, req.sampling.max_tokens, tpot_ms / 1e3, needed_features(req.sampling)

    async def first(self, req: RoutedRequest) -> Placement:
        """A role without any live worker is mostly a moment's gap: the last worker of a role draining while its
        replacement starts, or one the supervisor found slow and lists again at its next check. The request waits
        up to `no_workers_wait_s` (within the client's deadline, which cancels it) before UNAVAILABLE. Live workers
        of both roles none of which may be paired (a rollout of new weights between its halves) are no fault to
        recover from: the rollout brings the other half, so the request is shed with a retry hint instead."""
        try:
            return await self.within(self.config.no_workers_wait_s, self.args(req), frozenset, req.cache_salt)
        except UnpairedError as e:
            retry_ms = max(1, round(self.config.no_workers_wait_s * 1e3))
            raise OverloadedError(str(e), retry_after_ms=retry_ms, reason="unpaired") from None

    async def within(
        self,
        wait_s: float,
        args: tuple[list[int], int, float, frozenset[str]],
        avoid: Callable[[], frozenset[str]],
        cache_salt: bytes,
        must_hold: bool = False,
        weights: str | None = None,
    ) -> Placement:
        """A placement, tried again while no worker of a role is live (and not in `avoid()`, asked again at each
        try) for up to `wait_s`; then NoWorkersError. `weights`: only on workers of that model fingerprint."""
        end = time.monotonic() + wait_s
        while True:
            try:
                return await self.placement.place(*args, avoid(), cache_salt, must_hold, weights)
            except NoWorkersError as e:
                if time.monotonic() < end:
                    await asyncio.sleep(NO_WORKERS_POLL_S)
                elif wait_s > 0:  # an operator reading it learns what to raise to ride out longer restarts
                    raise type(e)(f"{e}; the router waited {wait_s:g} s for one (its no_workers_wait_s)") from None
                else:
                    raise

    async def again(
        self, req: RoutedRequest, failed: FailedWorkers, left: float | None, weights: str | None = None
    ) -> Placement:
        """On a worker that did not fail the request, else one that only refused it as full, was heard from since
        it failed (its heartbeat: alive) or restarted (a new address), waiting for one up to `no_workers_wait_s` over
        all the request's moves (within the caller's deadline), as a new request waits for a role's first worker.
        When none is left, on those of one role that did (the other role's still avoided), then on any live one: one
        that failed it may have recovered unheard (a stale registry view), better than failing the request while
        attempts and time remain. UnavailableError when no live decode worker holds it. (A stream went back at once
        to a dead decode worker's refusing port, three moves in 4 ms, while Ray restarted it; a retry did too.)
        `weights`: a moving stream's model fingerprint, the only workers it may go to."""
        args, registry = self.args(req), self.placement.registry
        with suppress(NoWorkersError):  # first on one that did not fail it at all
            return await self.placement.place(*args, failed.ids(), req.cache_salt, True, weights)
        wait_s = max(self.config.no_workers_wait_s - failed.waited_s, 2 * registry.refresh_s)
        started, avoid = time.monotonic(), partial(failed.unheard, registry)
        try:
            with suppress(NoWorkersError):
                return await self.within(
                    wait_s if left is None else min(wait_s, left), args, avoid, req.cache_salt, True, weights
                )
        finally:
            failed.waited_s += time.monotonic() - started
        # One role's failed workers back first, the other's still avoided: the only prefill worker blamed with its
        # decode worker (retry.avoided_workers) must not send the retry back to that decode worker too.
        for role in (Role.PREFILL, Role.DECODE):
            given_back = {w.worker_id for w in self.placement.registry.workers(role)}
            with suppress(NoWorkersError):
                still_avoided = failed.ids() - given_back
                return await self.placement.place(*args, still_avoided, req.cache_salt, True, weights)
        return await self.placement.place(*args, cache_salt=req.cache_salt, must_hold=True, weights=weights)

    async def with_room(
        self, req: RoutedRequest, failed: FailedWorkers, left: float | None, moves: Moves, weights: str
    ) -> Placement:
        """A migration's placement, on a decode worker that would take the stream (a place in its batch, free
        blocks for the prompt so far) when one does within `no_workers_wait_s` (and the caller's deadline): a
        sequence ending frees a place soon, while a stream sent to a full worker is refused and spends one of its
        moves. Meanwhile admission leaves it the next free place: its caller is mid-answer, a new request's can
        retry. Once per stream: a later move takes the best placement there is, which the worker may refuse, after
        the hint of a worker that refused it for room (a soak saw three moves spent on one full one in 0.1 s).
        Only on workers of `weights`, the model fingerprint its answer so far came from: other weights would go on
        from the streamed tokens with an answer of their own (NoWorkersError when none is live)."""
        self.tracker.moving += 1  # from the start: a place freed during the hint's wait is left to it too
        try:
            hint_s = moves.room_wait_s(self.config.no_workers_wait_s, left)
            await asyncio.sleep(hint_s)
            deadline = None if left is None else time.monotonic() + max(0.0, left - hint_s)
            wait_s = 0.0 if moves.waited_for_room else self.config.no_workers_wait_s
            end = time.monotonic() + wait_s if deadline is None else min(time.monotonic() + wait_s, deadline)
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())  # each wait within it
                placement = await self.again(req, failed, left, weights)
                takes = self.placement.predictor.takes(placement.decode, len(req.prompt_token_ids))
                if takes or time.monotonic() >= end:
                    return placement
                moves.waited_for_room = True
                await asyncio.sleep(NO_WORKERS_POLL_S)
        finally:
            self.tracker.moving -= 1

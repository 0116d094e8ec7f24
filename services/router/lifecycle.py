"""A request's life in the router, as code: build, admit (a ticket that owns the load bookkeeping), place,
relay the decode worker's stream, account for how it ended. The front ends (gRPC servicer, HTTP API) run it
through generation.py and only convert around it."""

from __future__ import annotations

import contextvars
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import aclosing, contextmanager, suppress

from opentelemetry import trace

from pdserve.config import RouterConfig
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import (
    ClusterAuthError,
    InternalError,
    InvalidRequestError,
    KVMismatchError,
    OverloadedError,
    RouterDrainingError,
    UnavailableError,
)
from pdserve.protocol.admitted import AdmittedTotals
from pdserve.protocol.model_config import ModelConfig
from pdserve.protocol.request_checks import check_request_id
from pdserve.redaction import recorded_text
from pdserve.registry.base import PrefixIndex
from pdserve.security.api_keys import KeyTable, Metadata, Tenant, authenticate
from pdserve.security.quotas import Choices, LocalQuotas, Quotas, QuotaSession
from pdserve.telemetry import CALLER_ANSWERS, Telemetry, mark_ended_by, request_id_var, step_span
from pdserve.v1 import generate_pb2 as pb
from services.router.admission import Admission, DeadlineTooShortError, SLOTarget
from services.router.caller_errors import cut_mid_stream, for_the_caller
from services.router.key_revocation import KeyedStream
from services.router.load_tracker import LoadTracker
from services.router.migration import Continuation, continued_request
from services.router.outcome import CALLER_ENDED, Caller, log_level, router_metrics
from services.router.own_holds import HOLD_FAILURES, OwnHolds
from services.router.placement import Placement, PlacementPolicy
from services.router.placement_waits import PlacementWaits
from services.router.recent_latencies import RecentLatencies
from services.router.relay import Clock, Relay
from services.router.request import RoutedRequest, build_request, capped_default
from services.router.retry import FailedWorkers, Moves, avoided_workers, blamed_worker, ejection_reason, record_move
from services.router.ticket import Ticket

log = logging.getLogger(__name__)
# What a client hears of a worker refusing the router's cluster credentials (which, where, why: the operator's log)
CLUSTER_AUTH_FAILED = "a worker refused this router's cluster credentials; the router's log has the details"
# The router's own key of the request being served in this context, for its log lines beside the client's id.
request_key_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_key", default=None)


class RequestLifecycle:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model: ModelConfig,
        config: RouterConfig,
        placement: PlacementPolicy,
        prefix_index: PrefixIndex,
        tracker: LoadTracker,
        telemetry: Telemetry,
        served_model: str = "",
        keys: KeyTable | None = None,
        quotas: Quotas | None = None,
    ) -> None:
        self.telemetry = telemetry
        self.served_model = served_model  # the name clients use for the model (the HTTP API's `model`)
        self.keys = keys  # None: an open cluster
        self.quotas = quotas or LocalQuotas()  # shared by the routers of a Redis registry, else this router's
        self.admission = Admission(config, placement.predictor, keys.weights if keys else {})
        self.metrics = router_metrics(telemetry.meter, keys, config, self.admission.shares.in_flight)
        self.recent = RecentLatencies()
        self.admitted = AdmittedTotals()
        self.tokenizer = tokenizer
        self.model = model
        self.config = config
        self.placement = placement
        placement.ejections.on_eject = self.metrics.ejected
        self.prefix_index = prefix_index
        self.tracker = tracker
        self.relay = Relay(telemetry, self.metrics, self.recent, placement, config)
        self.waits = PlacementWaits(placement, config, tracker)
        self.own_holds = OwnHolds()  # started with the router's server (server.py)
        self.draining = False
        self._placing = 0  # requests waiting for their placement (up to no_workers_wait_s), not yet admitted
        self._held = 0  # requests of several choices (`holding`)

    @property
    def in_flight(self) -> int:
        """What a drain waits for: admitted requests, those still being placed, which get their answer (the
        drain's UNAVAILABLE, once placed) before the server stops, and requests of several choices to their end."""
        return self.admission.in_flight + self._placing + self._held

    def authenticate(self, metadata: Metadata) -> Tenant:
        """The caller's tenant from its `authorization` metadata (UnauthenticatedError without a known key)."""
        return authenticate(self.keys, metadata)

    def identify(self, msg: pb.GenerateRequest) -> tuple[str, str]:
        """The request's own key and its caller's id (the key when it gave none), which tag its span and log lines
        from here on: before its key's quotas are charged, so that a refusal there is logged under that id too."""
        check_request_id(msg.request_id, self.config.request_limits)  # before it tags spans and log lines
        key = uuid.uuid4().hex
        client_id = msg.request_id or key
        request_id_var.set(client_id)
        request_key_var.set(key)
        trace.get_current_span().set_attributes({"request.id": key, "request.client_id": client_id})
        return key, client_id

    async def admit(
        self,
        msg: pb.GenerateRequest,
        ids: tuple[str, str],
        started_at: float,
        quota: QuotaSession,
        default_max_tokens: int | None = None,
        time_remaining: Callable[[], float | None] = lambda: None,
    ) -> Ticket:
        """Build, place and admit, or raise before anything is sent: InvalidRequestError, OverloadedError,
        UnavailableError, PermissionDeniedError, DeadlineTooShortError (`time_remaining` ends first). `ids`: its own
        key and its caller's id (`identify`); the caller's request_id is only echoed. Its prompt and max_tokens are
        charged to its key's token rate. Without max_tokens: `default_max_tokens` (never past the router's default,
        nor the context's or KV's room)."""
        key, client_id = ids
        with step_span(self.telemetry.tracer, "admission", request__id=key, request__client_id=client_id) as span:
            quota.tenant.check_priority(msg.priority)
            default = capped_default(default_max_tokens, self.config.default_max_tokens)
            kv_room = self.placement.kv_capacity_tokens()
            req = await build_request(
                msg, self.tokenizer, self.model, default, self.config.request_limits, quota.tenant.name, kv_room
            )
            span.set_attribute("prompt_tokens", len(req.prompt_token_ids))
            try:
                placement, slo = await self.place(req, admitted_before=quota.later_choice)
                # What never fits is refused first: a shed's retry hint (the key's token rate's too) would lead
                # only to it. A later choice was judged with the first.
                choices = None if quota.later_choice else quota.choices
                self.admission.check_feasible(placement, len(req.prompt_token_ids), slo, choices)
                await quota.charge_tokens(len(req.prompt_token_ids) + req.sampling.max_tokens)
                # A drain begun during the charge (a Redis round trip) counted no such request, and stops once the
                # requests it counted end: none may be admitted past it.
                self._refuse_when_draining(quota.later_choice)
                try:
                    tenant = None if quota.later_choice else req.tenant  # its share was judged at the first choice
                    left_s = time_remaining()
                    self.admission.check_load(placement, len(req.prompt_token_ids), req.priority, slo, left_s, tenant)
                except (OverloadedError, DeadlineTooShortError) as e:
                    if not isinstance(e, DeadlineTooShortError) or e.by_load:
                        self.admitted.turned_away(len(req.prompt_token_ids))  # demand the cluster could not take
                    raise
            except (OverloadedError, InvalidRequestError, TimeoutError) as e:
                span.set_attribute("rejected", recorded_text(e))
                raise
            quota.admitted()
            self.admitted.add(len(req.prompt_token_ids), req.sampling.max_tokens)
        prefill, decode = placement.prefill_worker, placement.decode
        trace.get_current_span().set_attributes(
            {"prefill.worker.id": prefill.worker_id, "decode.worker.id": decode.worker_id}
        )
        self.prefix_index.record(prefill.cache_key, placement.block_hashes)
        return Ticket(key, client_id, req, placement, started_at, self.tracker, self.admission)

    async def place(self, req: RoutedRequest, admitted_before: bool = False) -> tuple[Placement, SLOTarget]:
        """The request's placement and its SLO. `admitted_before`: a later choice of an admitted request (`holding`)."""
        self._refuse_when_draining(admitted_before)
        ttft_ms, tpot_ms = self.config.slo_for(req.priority, req.ttft_slo_ms, req.tpot_slo_ms)
        with step_span(self.telemetry.tracer, "placement") as span:
            self._placing += 1
            try:
                placement = await self.waits.first(req)
            finally:
                self._placing -= 1
            self._refuse_when_draining(admitted_before)  # it began while the request waited for a worker
            span.set_attribute("prefill.worker.id", placement.prefill_worker.worker_id)
            span.set_attribute("decode.worker.id", placement.decode.worker_id)
            span.set_attribute("cached_tokens", placement.cached_tokens)
            span.set_attribute("predicted_ttft_s", placement.predicted_ttft_s)
            # Its parts, for comparing with the workers' spans (docs/experiments/ttft_prediction/)
            span.set_attribute("predicted_own_ttft_s", placement.own_ttft_s)
            span.set_attribute("predicted_fixed_s", placement.fixed_s)  # of the own TTFT: fixed_cost.py
            span.set_attribute("ttft_factor", placement.ttft_factor)  # what multiplied its compute: calibration.py
            span.set_attribute("predicted_prefill_queue_s", placement.prefill_queue_s)
            span.set_attribute("predicted_queue_s", placement.queue_s)
            span.set_attribute("predicted_profiled_queue_s", placement.profiled_queue_s)
        return placement, SLOTarget(ttft_ms / 1e3, tpot_ms / 1e3, req.ttft_slo_ms > 0, req.tpot_slo_ms > 0)

    @contextmanager
    def holding(self) -> Iterator[None]:
        """A request of several choices stays in flight from its first to its last choice's end, so a drain waits
        for the choices not yet admitted (each starts once the one before it has its first token)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1

    def refuse_new_when_draining(self) -> None:
        """Before a new request's key is charged: refused for the drain, its retry on another replica (with quotas
        shared in Redis) must find the key's rate as it was."""
        self._refuse_when_draining(admitted_before=False)

    def _refuse_when_draining(self, admitted_before: bool) -> None:
        if self.draining and not admitted_before:
            raise RouterDrainingError("the router is draining; retry on another replica")

    async def stream(
        self, ticket: Ticket, time_remaining: Callable[[], float | None], arrived_at: float, keyed: KeyedStream
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The decode worker's stream. When an attempt fails with UNAVAILABLE the request moves to other workers,
        each attempt with its own ticket: retried as it came before any message reached the caller (up to
        `max_attempts` placements), migrated with the tokens already streamed after (up to `migration_limit`),
        also past a worker that has no room for the stream it was moved to. A worker that refused the router's
        cluster credentials is such a failure; when it is the last, the caller gets UNAVAILABLE without its
        detail. Any other failure reaches the caller with the workers named by id, not address (caller_errors)."""
        clock = Clock(arrived_at, len(ticket.request.prompt_token_ids))
        original, chunks, moves, failed, done = ticket.request, [], Moves(), FailedWorkers(), False
        try:
            while True:
                try:
                    async with aclosing(self.relay.stream(ticket, time_remaining(), clock, keyed)) as relayed:
                        async for msg in relayed:
                            chunks.append(list(msg.token_ids))
                            done = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                            if done:
                                self.admitted.finish(sum(map(len, chunks)))
                            yield msg
                    return
                except UnavailableError as e:
                    if done:  # the last message is out: a worker lost after it leaves nothing to redo
                        return
                    # A pair refused for other weights (a registry view older than a worker's restart onto new
                    # ones) moves the request; neither worker failed, so neither leaves placement.
                    eject = not isinstance(e, KVMismatchError)
                    ticket = await self._move(ticket, e, original, chunks, moves, failed, time_remaining(), eject)
                except OverloadedError as e:
                    # The worker had no room when the request got there, though this router saw room (another
                    # router's stream, or a migration, took it): another may. Else, before any message, it is
                    # shed as admission sheds (a retry may fit); after, the cluster could not recover the stream,
                    # which the caller's retry would start over, not continue.
                    full = UnavailableError(f"{e} (to continue a stream of {sum(map(len, chunks))} tokens)")
                    moves.room_hint_s = e.retry_after_ms / 1e3 if chunks else 0.0  # a move mid-stream waits it
                    args = (original, chunks, moves, failed, time_remaining())
                    ticket = await self._move(ticket, full if chunks else e, *args, eject=False)
        except ClusterAuthError:
            raise UnavailableError(CLUSTER_AUTH_FAILED) from None
        except (UnavailableError, OverloadedError, TimeoutError, InvalidRequestError, InternalError) as e:
            told = for_the_caller(cut_mid_stream(e, sum(map(len, chunks))), ticket.placement)
            if told is e:
                raise
            log.log(log_level(e), "request failed: %s", e, extra={"key": ticket.key})
            raise told from None
        finally:
            ticket.release()

    async def _move(
        self,
        ticket: Ticket,
        error: UnavailableError | OverloadedError,
        original: RoutedRequest,
        chunks: list[list[int]],
        moves: Moves,
        failed: FailedWorkers,
        left: float | None,
        eject: bool = True,
    ) -> Ticket:
        """A new ticket on workers that did not fail the request (the old one released), or `error` raised again
        when it may not or cannot move (the caller's `finally` releases the old one). `eject`: the worker failed,
        rather than being full, so it leaves placement for a while. A request refused as full before its first
        message goes only to another worker, one with room as far as this router sees; a stream moving mid-answer
        only to workers of the weights its answer so far came from."""
        worker = blamed_worker(error, ticket.placement)
        reason = ejection_reason(error)
        if eject and reason in HOLD_FAILURES and self.own_holds.excuse():
            log.debug("worker %s not ejected: it failed as the router's own hold ended: %s", worker.worker_id, error)
        elif eject:
            self.placement.ejections.eject(worker, reason, str(error))
        failed.add(avoided_workers(worker, ticket.placement, error), self.placement.registry, fault=eject)
        ticket.leave_workers()  # this attempt holds no place there while the next is found (still in flight)
        streamed = [t for chunk in chunks for t in chunk]
        if not moves.allow(self.config, len(streamed) if chunks else -1, original.sampling.max_tokens, left):
            raise error
        req = continued_request(original, streamed) if chunks else original
        try:
            if chunks:
                weights = ticket.placement.decode.model_fingerprint  # its answer so far is of these weights
                placement = await self.waits.with_room(req, failed, left, moves, weights)
            elif isinstance(error, OverloadedError):
                placement = await self.waits.within(0.0, self.waits.args(req), failed.ids, req.cache_salt, True)
                if not self.admission.predictor.takes(placement.decode, len(req.prompt_token_ids)):
                    raise error
            else:
                placement = await self.waits.again(req, failed, left)
        except UnavailableError:
            raise error from None  # no worker live at all: the failure itself is the answer
        attempt = 1 + moves.retries + moves.migrations
        key = f"{ticket.key.split('.')[0]}.{attempt}"
        record_move(self.metrics, worker, error, placement, attempt, key, len(streamed) if chunks else None)
        self.prefix_index.record(placement.prefill_worker.cache_key, placement.block_hashes)
        continuation = Continuation(self.tokenizer.backend, original, chunks) if chunks else None
        started = time.perf_counter()
        moved = Ticket(key, ticket.client_id, req, placement, started, self.tracker, self.admission, continuation)
        ticket.release()  # only now: the request stays in flight throughout (a drain waits for it)
        return moved

    def refused(self, error: BaseException, started_at: float, tenant: Tenant | None = None) -> None:
        """A request its front end refused before it had a GenerateRequest (an HTTP caller without a valid key,
        a body of the wrong shape): counted and logged as `accounting` counts any such refusal, under the
        caller's tenant once its key was checked."""
        with suppress(type(error)), self.accounting(started_at) as caller:
            caller.tenant = tenant
            raise error

    @contextmanager
    def accounting(self, started_at: float, choices: Choices | None = None) -> Iterator[Caller]:
        """Counts the request by how it ended and by tenant, and logs it once. One of `choices` (the HTTP API's
        `n`) cancelled because another failed ends as that one did; the first to fail says so in `choices`."""
        outcome, caller = "failed", Caller(self.metrics)
        try:
            yield caller
            outcome = "finished"
        except BaseException as e:
            sibling = choices.failure if choices is not None else None
            outcome = caller.outcome(sibling if sibling is not None and caller.outcome(e) in CALLER_ENDED else e)
            if outcome in CALLER_ENDED and (span := trace.get_current_span()).is_recording():
                span.set_attribute(outcome, True)  # the HTTP API's span has no status code saying so
            elif outcome not in CALLER_ENDED and choices is not None and sibling is None:
                choices.failure = e
            if outcome not in CALLER_ENDED and isinstance(e, CALLER_ANSWERS):  # the span says why, whichever step
                mark_ended_by(trace.get_current_span(), e)  # refused it
            raise
        finally:
            e2e_s = time.perf_counter() - started_at
            caller.ended(outcome, e2e_s)
            if self.config.access_log:  # one line a request (--no-access-log: none)
                extra = {"outcome": outcome, "e2e_ms": round(e2e_s * 1e3, 2), "request_key": request_key_var.get()}
                log.info("request %s", outcome, extra=extra | {"tenant": caller.label})

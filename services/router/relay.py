"""Relaying the decode worker's stream to the caller: the first-token and stall bounds, latency metrics, usage."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from pdserve.config import RouterConfig
from pdserve.errors import RouterStoppedError, UnavailableError
from pdserve.metrics import RouterMetrics
from pdserve.registry.base import WorkerState
from pdserve.rpc.channel_pool import ChannelPool
from pdserve.rpc.convert import sampling_to_pb
from pdserve.rpc.credentials import internal_tls_files
from pdserve.rpc.errors import error_from_rpc
from pdserve.rpc.metadata import HANDOFF_STARTED_KEY, PREFILL_WAITED_KEY
from pdserve.rpc.stream_end import cancel_stream
from pdserve.security.cluster_secret import ClusterSecret
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc
from services.router.abandon import Abandons
from services.router.key_revocation import KeyedStream, KeyedStreams, KeyRevokedError
from services.router.placement import Placement, PlacementPolicy
from services.router.recent_latencies import RecentLatencies
from services.router.slo_attainment import judged_slo
from services.router.stall import next_message, read_within
from services.router.ticket import Ticket
from services.router.unlisted import Listing, UnlistedCheck
from services.router.worker_frees import freed_at


class NoFirstTokenError(UnavailableError):
    """No first token within the router's bound: the router's ejection counts it as `no_first_token`."""


@dataclass
class Clock:
    """One stream's timings, from the router's receipt of the request, across all its attempts."""

    start: float
    prompt_tokens: int  # the client's prompt, however long a migrated attempt's is
    ttft_s: float = 0.0
    last_token_at: float = 0.0
    completion_tokens: int = 0


class Relay:
    def __init__(
        self,
        telemetry: Telemetry,
        metrics: RouterMetrics,
        recent: RecentLatencies,
        placement: PlacementPolicy,
        config: RouterConfig,
    ) -> None:
        self.telemetry = telemetry
        self.config = config
        self.metrics = metrics
        self.recent = recent
        self.calibration = placement.predictor.calibration  # learns from the TTFTs of requests that ran alone
        self.fixed_cost = placement.predictor.fixed_cost  # and this, before it, from the same
        self.load_calibration = placement.predictor.load_calibration  # and this from the others'
        self.listing = Listing(placement.registry)  # a placed worker gone before the first token: moved at once
        self.first_token_s = config.first_token_timeout_s
        self.stall_s = config.stall_timeout_s  # the longest silence after the first message (services/router/stall.py)
        self.channels = ChannelPool(
            worker_pb2_grpc.DecodeWorkerStub, telemetry.client_interceptors(), credential_files=internal_tls_files()
        )
        self.cluster = ClusterSecret.from_env()  # grants the decode worker the prefill address placed
        self._calls: set[grpc.aio.UnaryStreamCall] = set()  # the decode calls being relayed
        self._stopped: str | None = None  # why every stream was cut (`cut_all`), once it was
        self.keyed = KeyedStreams()  # each request under its API key: a key's revocation cuts its streams
        # A prefill worker told of an attempt given up on before its first token.
        self.abandons = Abandons(telemetry.client_interceptors())

    def cut_all(self, why: str) -> int:
        """Ends every stream relayed now or later with RouterStoppedError saying `why` (its decode call cancelled,
        which frees its blocks): a router stopping past its drain's grace tells its callers so, rather than
        gRPC's bare "Cancelling all calls" when its server stops. Returns how many were open."""
        self._stopped = why
        for call in self._calls:
            call.cancel()
        return len(self._calls)

    async def stream(
        self, ticket: Ticket, time_remaining: float | None, clock: Clock, keyed: KeyedStream | None = None
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The decode worker's messages, each carrying the caller's request_id, the last one usage. Cancelling
        the decode call (done here however the stream ends) cancels its prefill and frees blocks on both. The
        first-token bound counts from `ticket.started_at` (this attempt's start), latencies from `clock`'s.
        `keyed`: the request's hold on its API key, whose revocation cancels the call (KeyRevokedError)."""
        p, req = ticket.placement, ticket.request
        forward = wpb.WorkerGenerateRequest(
            request_id=ticket.key,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_to_pb(req.sampling),
            prefill_address=p.prefill.address if p.prefill else "",
            prefill_grant=self.cluster.prefill_grant(ticket.key, p.prefill.address) if p.prefill else b"",
            client_request_id=ticket.client_id,
            cache_salt=req.cache_salt,
            resumed_output_tokens=req.resumed_output_tokens,
            tenant=req.tenant,
            priority=req.priority,
        )
        if self._stopped is not None:  # a stream moved after the cut
            raise RouterStoppedError(self._stopped)
        if keyed is not None:  # revoked while it was admitted or moved
            keyed.check(clock.completion_tokens)
        ticket.dispatched_at = time.perf_counter()
        call = self.channels.call(p.decode.address, lambda stub: stub.Generate(forward, timeout=time_remaining))
        trailing: grpc.aio.Metadata | None = None
        self._calls.add(call)
        if keyed is not None:
            keyed.call = call
        try:
            msg = await self._first(call, ticket, time_remaining)
            while msg is not None:
                if msg.token_ids or msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:  # else: preempted, waiting
                    relayed = self._relayed(msg, ticket, clock)
                    yield relayed
                    if ticket.continuation is not None and relayed.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        return  # a migrated stream may end on a stop string its decode worker did not see
                msg = await read_within(call, self.stall_s, p.decode)
            trailing = await call.trailing_metadata()
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, f"decode worker {p.decode.worker_id} at {p.decode.address}") from e
        except asyncio.CancelledError:  # how a read of a call cancelled here ends: by `cut_all` or its key's
            task = asyncio.current_task()  # revocation, unless the task was cancelled
            if task is not None and task.cancelling():
                raise
            if keyed is not None and keyed.revoked:
                raise KeyRevokedError(clock.completion_tokens) from None
            if self._stopped is None:
                raise
            raise RouterStoppedError(f"{self._stopped} ({clock.completion_tokens} tokens sent)") from None
        finally:
            self._calls.discard(call)
            if keyed is not None:
                keyed.call = None
            self._calibrate(ticket, trailing)
            ticket.freed_at = freed_at(p.decode.instance, trailing)
            await cancel_stream(call)  # a no-op once finished

    def _calibrate(self, ticket: Ticket, trailing: grpc.aio.Metadata | None) -> None:
        """An attempt that ran alone as far as this router saw teaches calibration, once it ended (the wait comes in
        the decode worker's trailing metadata). With the wait its prefill worker reports (other routers' prompts
        ahead of it, which would read as a slow worker), its TTFT less that wait against the prediction less its
        queue; without (a stream that did not end OK, a colocated worker), its TTFT against the whole prediction.
        The prediction before the load's factor (load_calibration.py), which requests that did not run alone teach.
        The fixed cost learns first, from the TTFT less the prediction's parts other than it and the compute; the
        factor then learns the rest, with that fixed cost taken off: the factor that would have predicted it."""
        if ticket.alone_ttft_s is None or ticket.placement.cached_tokens:
            return  # a prefix-cache hit's TTFT holds a cost the prediction does not price (reading its cached tokens)
        waited = dict(trailing or ()).get(PREFILL_WAITED_KEY)
        p, measured_s = ticket.placement, ticket.alone_ttft_s
        predicted_s = p.own_ttft_s + p.profiled_queue_s
        if isinstance(waited, str) and waited.isdigit():
            measured_s, predicted_s = measured_s - int(waited) / 1e3, predicted_s - p.prefill_queue_s
        worker, others_s = p.prefill_worker.worker_id, predicted_s - p.fixed_s - p.ttft_factor * p.compute_s
        fixed_s = self.fixed_cost.observe(worker, p.compute_s, measured_s - others_s)
        self.calibration.observe(worker, predicted_s - p.fixed_s, measured_s - fixed_s, p.ttft_factor)

    def _calibrate_load(self, p: Placement, measured_s: float) -> None:
        """An attempt placed behind queueing that did not run alone teaches the load's factor at its first token:
        its TTFT against its prediction before that factor."""
        if p.cached_tokens:
            return  # as in `_calibrate`
        self.load_calibration.observe(p.prefill_worker.worker_id, p.own_ttft_s, p.profiled_queue_s, measured_s)

    async def _first(
        self, call: grpc.aio.UnaryStreamCall, ticket: Ticket, time_remaining: float | None
    ) -> pb.GenerateResponse | None:
        """The first message, within the router's first-token bound unless the caller's deadline is sooner
        (the decode call carries that one, and ends in DEADLINE_EXCEEDED), and while its workers stay listed."""
        bound = self.first_token_s - (time.perf_counter() - ticket.started_at)
        by_deadline = time_remaining is not None and time_remaining <= bound
        handed_off = asyncio.ensure_future(_handoff_started(call))
        try:
            # In this task, not one of wait_for's: a caller's cancel repeated while wait_for waited for its read
            # task to end left that read running, and the cleanup's read of the call then failed the request.
            async with asyncio.timeout(None if by_deadline else max(bound, 0.0)) as timeout:
                unlisted = UnlistedCheck(timeout, self.listing, ticket.placement)
                try:
                    return await next_message(call)
                finally:
                    unlisted.cancel()
        except TimeoutError:
            call.cancel()
            self._abandon(ticket, unlisted.gone)
            if unlisted.gone is not None:
                raise unlisted.error() from None
            raise NoFirstTokenError(self._no_first_token(ticket.placement, handed_off)) from None
        except (asyncio.CancelledError, grpc.aio.AioRpcError):  # the caller left or its deadline passed, the router
            self._abandon(ticket)  # cut the stream, or the decode worker failed it
            raise
        finally:
            handed_off.cancel()

    def _abandon(self, ticket: Ticket, gone: WorkerState | None = None) -> None:
        """Tells the attempt's prefill worker, unless it is the one `gone`, that the attempt ended before its first
        token: its decode worker passes a cancel on itself, but a stopped one cannot (services/router/abandon.py)."""
        prefill = ticket.placement.prefill
        if prefill is not None and prefill is not gone:
            self.abandons.send(prefill, ticket.key)

    async def close_channels(self) -> None:
        """Closes the channels to decode workers and those of the abandons (cancelling their calls in flight)."""
        try:
            await self.abandons.close()
        finally:
            await self.channels.close()

    def _no_first_token(self, p: Placement, handed_off: asyncio.Future[bool]) -> str:
        """Names the prefill worker's address (which blames it, services/router/retry.py) only when the decode
        worker said it had called it: a decode worker silent from the start is the stuck one."""
        bound = f"no first token within the router's bound of {self.first_token_s:g} s"
        decode = f"decode worker {p.decode.worker_id} at {p.decode.address}"
        if p.prefill is None:
            return f"{bound} from {decode}; the request was cancelled there"
        if handed_off.done() and not handed_off.cancelled() and handed_off.result():
            return (
                f"{bound}: {decode} was waiting on prefill worker {p.prefill.worker_id} at {p.prefill.address}; "
                "the request was cancelled there"
            )
        return f"{bound}: {decode} never handed the prompt to prefill worker {p.prefill.worker_id}; it was cancelled"

    def _relayed(self, msg: pb.GenerateResponse, ticket: Ticket, clock: Clock) -> pb.GenerateResponse:
        now = time.perf_counter()
        if msg.token_ids and not clock.ttft_s:
            clock.ttft_s = now - clock.start
            self.metrics.ttft.record(clock.ttft_s, {"tenant": ticket.request.tenant})
            # The workers are judged by this attempt's TTFT from its dispatch: a retry's request TTFT holds the
            # failed attempt's, and any request's the router's own work before the call.
            attempt_s, p = now - ticket.dispatched_at, ticket.placement
            for worker in {p.prefill_worker.worker_id, p.decode.worker_id}:
                self.recent.add(worker, "ttft", attempt_s)
            if ticket.ran_alone():
                ticket.alone_ttft_s = attempt_s
            else:
                self._calibrate_load(p, attempt_s)
            for _ in msg.token_ids[1:]:  # tokens that came with the first: no gap after it
                self.metrics.itl.record(0.0)
        elif msg.token_ids:  # a message with several tokens (a worker catching up) spreads its gap over them
            gap = (now - clock.last_token_at) / len(msg.token_ids)
            for _ in msg.token_ids:
                self.metrics.itl.record(gap)
        if msg.token_ids:
            ticket.prefilled()  # once per ticket: this attempt's first token
            ticket.first_token_at = ticket.first_token_at or now
            ticket.streamed(len(msg.token_ids))
            clock.last_token_at = now
        if ticket.continuation is not None:
            ticket.continuation.rewrite(msg)  # may drop tokens past a stop string the new worker did not see
        clock.completion_tokens += len(msg.token_ids)
        msg.request_id = ticket.client_id
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self._finish(msg, ticket, clock, now)
        return msg

    def _finish(self, msg: pb.GenerateResponse, ticket: Ticket, clock: Clock, now: float) -> None:
        """Usage on the last message; TPOT as vLLM defines it, (e2e - TTFT) / (tokens - 1)."""
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=clock.prompt_tokens,
                completion_tokens=clock.completion_tokens,
                ttft_ms=clock.ttft_s * 1e3,
                cached_prompt_tokens=min(msg.usage.cached_prompt_tokens, clock.prompt_tokens),
            )
        )
        tenant, tpot_s = ticket.request.tenant, 0.0
        if clock.completion_tokens > 1:
            tpot_s = (now - clock.start - clock.ttft_s) / (clock.completion_tokens - 1)
            self.metrics.tpot.record(tpot_s, {"tenant": tenant})
        slo, ttft_bound_s, tpot_bound_s = judged_slo(self.config, ticket.request)
        self.metrics.slo_judged(tenant, slo, clock.ttft_s <= ttft_bound_s, tpot_s <= tpot_bound_s)
        if ticket.tokens > 1:  # the worker by its own attempt: a moved stream's stall and new prefill are not its
            self.recent.add(
                ticket.placement.decode.worker_id, "tpot", (now - ticket.first_token_at) / (ticket.tokens - 1)
            )
        trace.get_current_span().set_attribute("completion_tokens", clock.completion_tokens)


async def _handoff_started(call: grpc.aio.UnaryStreamCall) -> bool:
    """Whether the decode worker's initial metadata says it called its prefill worker."""
    try:
        return any(key == HANDOFF_STARTED_KEY for key, _ in (await call.initial_metadata() or ()))
    except grpc.aio.AioRpcError:
        return False

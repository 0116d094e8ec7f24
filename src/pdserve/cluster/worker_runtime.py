"""One worker process: its engine on the engine thread, its gRPC server on an asyncio loop thread.

The same class runs under Ray (as an actor) and in tests; its public methods are cheap and
thread-safe, so a Ray actor can answer health checks while the model runs.

A worker that can no longer serve (its start failed, or its engine thread died) says so and leaves: NOT_SERVING,
out of the registry, its in-flight requests failed with UNAVAILABLE, and under Ray (`spec.exit_on_fatal`) its
process exits, which is how an actor asks Ray for a restart (`ray.actor.exit_actor` would end it for good).

A drain (SIGTERM to the process, or the WorkerControl `Drain` RPC) takes it out of placement at once (its state
says `draining`), lets its requests finish or move (`drain.py`), then leaves: its state raises WorkerDrainedError,
which its supervisor answers with a new actor in its place; under Ray the process exits a little later in case no
supervisor does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import asdict, replace
from functools import partial
from typing import TYPE_CHECKING

from pdserve.build import current_build
from pdserve.cluster.drain import DrainGate, DrainReport, WorkerDrainedError, run_drain
from pdserve.cluster.drain_service import add_control_service
from pdserve.cluster.factories import WorkerContext, WorkerServices
from pdserve.cluster.speed_recheck import SpeedRecheck
from pdserve.cluster.start_faults import fail_first_start, slowed_profile
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.protocol.compatibility import KV_WIRE_VERSION, WORKER_FEATURES
from pdserve.protocol.roles import Role
from pdserve.redaction import redacted_url
from pdserve.registry.base import WorkerState
from pdserve.rpc.credentials import internal_server_tls
from pdserve.security.cluster_secret import ClusterSecret

if TYPE_CHECKING:
    from pdserve.engine.cache_journal import PrefixCacheChanges
    from pdserve.registry.redis import RedisRegistry

log = logging.getLogger(__name__)
HEARTBEAT_FAILURE_LOG_EVERY_S = 30.0
# A whole copy of the prefix cache into its index entry comes at most this often after the first two: one of a
# 262k-block cache holds Redis ~0.5 s, and a router of an earlier build undoing the entry each beat asks for one each
# beat.
WHOLE_COPY_EVERY_S = 30.0
EXIT_GRACE_S = 1.0  # a failing worker's last words: its callers get their status, the launcher the reason
DRAINED_EXIT_S = 10.0  # a drained worker's supervisor replaces it within this; else the process exits by itself


class WorkerUnavailableError(RuntimeError):
    """The worker is starting, or is leaving because it can no longer serve: keep it out of placement."""


class WorkerRuntime:
    def __init__(self, spec: WorkerSpec, services: WorkerServices) -> None:
        """`services` adds the role's gRPC services (built outside this package) once the engine is loaded."""
        from pdserve.addresses import advertised_host

        self.requested = spec  # as the fleet asked for it (a later fleet compares its own: rollout.py)
        self.spec = replace(
            spec,
            worker_id=spec.worker_id or f"{spec.role}-{uuid.uuid4().hex[:8]}",
            advertise_host=advertised_host(spec.host, spec.advertise_host),  # here: on the worker's own node
        )
        self._services = services
        self._instance = uuid.uuid4().hex  # this runtime's own: a restart under the same id and address differs
        from pdserve.log_setup import configure_logging
        from pdserve.telemetry import Telemetry

        if spec.log_level:
            configure_logging(spec.log_level, service=f"pdserve-{spec.role}", worker_id=self.spec.worker_id)
        self.telemetry = Telemetry(f"pdserve-{spec.role}")
        self._metrics_address = ""
        self._ready: Future[str] = Future()
        self._loop = asyncio.new_event_loop()
        self._stopped = threading.Event()
        self._fatal: BaseException | None = None  # why this worker can no longer serve
        self._heartbeat_thread: threading.Thread | None = None
        self._beat = threading.Event()  # set: heartbeat now (the registry learns of a drain at once)
        self._whole_copied_at = -math.inf  # when the prefix cache last went whole into its index entry
        self._drain: asyncio.Future[DrainReport] | None = None
        self._drained = False
        self._gate = DrainGate(self.spec.worker_id)
        self._recheck = SpeedRecheck(spec.role, spec.speed_recheck_idle_s, spec.speed_recheck_s)
        self._thread = threading.Thread(target=self._run, name="worker-rpc", daemon=True)
        self._thread.start()
        if spec.exit_on_fatal:  # a process of its own: SIGTERM drains it
            from pdserve.cluster.signals import on_sigterm

            on_sigterm(self._drain_on_sigterm)

    def address(self, timeout_s: float = 600.0) -> str:
        """Blocks until the model is loaded, warmed up and the server reports SERVING."""
        return self._ready.result(timeout=timeout_s)

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    def requested_spec(self) -> WorkerSpec:
        return self.requested

    def set_log_level(self, level: str | None) -> None:
        """A fleet's new log level, taken without a restart; the spec it reports says so from now on."""
        from pdserve.log_setup import configure_logging

        if level:
            configure_logging(level, service=f"pdserve-{self.spec.role}", worker_id=self.spec.worker_id)
        self.requested = replace(self.requested, log_level=level)
        self.spec = replace(self.spec, log_level=level)

    def wait_ready(self, timeout_s: float = 600.0) -> str:
        """The launcher's wait for the start; raises the start's own error if it failed."""
        return self.address(timeout_s)

    def state(self) -> WorkerState:
        """What routers need to know of this worker now: identity, profile, load. Never waits: raises
        WorkerUnavailableError while it starts or once it can no longer serve."""
        if self._drained:
            raise WorkerDrainedError(f"worker {self.worker_id} drained: start a new one in its place")
        if not self._ready.done() or self._ready.exception() is not None:
            raise WorkerUnavailableError(f"worker {self.worker_id} is not started")
        if self._fatal is not None or not self._engine.alive:
            raise WorkerUnavailableError(f"worker {self.worker_id} can no longer serve: {self._fatal!r}")
        stats = self._engine.stats
        return WorkerState(
            worker_id=self.worker_id,
            role=self.spec.role,
            address=self._server.address,
            model_fingerprint=self._engine.fingerprint,
            tokenizer=self._engine.tokenizer_digest,
            block_size=self._engine.block_size,
            kv_bytes_per_token=self._engine.kv_bytes_per_token,
            kv_blocks_total=stats["kv_blocks_total"],
            kv_blocks_free=stats["kv_blocks_free"],
            kv_blocks_owed=stats["kv_blocks_owed"],
            kv_blocks_cached=stats["kv_blocks_cached"],
            queued_prefill_tokens=stats["queued_prefill_tokens"],
            queued_prefill_prompts=stats["queued_prefill_prompts"],
            queued_prefill_token_squares=stats["queued_prefill_token_squares"],
            short_prompt_tokens=stats["short_prompt_tokens"],
            queued_short_prefill_prompts=stats["queued_short_prefill_prompts"],
            queued_short_prefill_tokens=stats["queued_short_prefill_tokens"],
            queued_short_prefill_token_squares=stats["queued_short_prefill_token_squares"],
            prefill_chunk_s=stats["prefill_chunk_us"] / 1e6,
            prefill_stretch=stats["prefill_stretch_milli"] / 1e3,
            running=stats["running"],
            waiting=stats["waiting"],
            max_num_seqs=self._engine.max_num_seqs,
            sequences=stats["sequences"],
            sequences_freed=stats["sequences_freed"],
            load_at=stats["sampled_at_ns"] / 1e9,
            load_age_s=max(0, time.monotonic_ns() - stats["sampled_mono_ns"]) / 1e9,
            profile=self._speed.profile,
            speed_factor=self._speed.factor,
            metrics_address=self._metrics_address,
            pid=os.getpid(),
            instance=self._instance,
            draining=self._drain is not None,
            build=current_build(),
            features=WORKER_FEATURES,
            kv_wire_version=KV_WIRE_VERSION,
        )

    def _heartbeat(self) -> None:
        from pdserve.registry.redis import RedisRegistry
        from pdserve.registry.redis_prefix import drop_own_entry
        from pdserve.throttled_log import Throttled

        assert self.spec.registry_url is not None
        registry = RedisRegistry(self.spec.registry_url, ttl_s=max(2.0, 6 * self.spec.heartbeat_s))
        failed = Throttled(HEARTBEAT_FAILURE_LOG_EVERY_S, log)  # a Redis outage is one line per interval, not per beat
        shown = redacted_url(self.spec.registry_url)  # what its failures may say of it
        cache_key = ""  # this process's prefix-index entry, once it published one
        while not self._stopped.is_set():
            self._beat.wait(self.spec.heartbeat_s)
            self._beat.clear()
            if self._stopped.is_set():
                break
            try:
                state = self.state()
                registry.publish(state)
            except Exception as e:  # Redis down: keep serving, publish again when it is back
                failed.warning("heartbeat to %s failed: %s", shown, e)
                continue
            try:
                self._index_prefix_changes(registry, state, first=not cache_key)
                cache_key = state.cache_key
            except Exception as e:  # the next beat sends the whole cache
                failed.warning("prefix-cache changes not written to %s: %s", shown, e)
        try:
            registry.remove(self.worker_id)
            if cache_key and self._engine.prefix_journal is not None:
                drop_own_entry(registry.client, cache_key)
        except Exception as e:
            log.warning("could not deregister %s: %s", self.worker_id, e)

    def _index_prefix_changes(self, registry: RedisRegistry, state: WorkerState, first: bool) -> None:
        """What the prefix cache keyed and evicted since the last beat, into this process's prefix-index entry;
        `first`: none went in yet (its worker id's earlier processes' entries go then)."""
        from pdserve.registry.redis_prefix import apply_changes

        if (journal := self._engine.prefix_journal) is None:
            return
        if journal.whole_next and not first and time.monotonic() - self._whole_copied_at < WHOLE_COPY_EVERY_S:
            return  # the index goes without these changes a while, rather than Redis copying a whole cache each beat
        try:
            changes = journal.take()
            intact = apply_changes(registry.client, state.cache_key, changes, first)
        except Exception:  # a copy cut short starts no wait: the next beat copies it again
            journal.lost()
            raise
        if changes.whole and not first:  # nor does the first: a Redis restarted after it is copied at once
            self._whole_copied_at = time.monotonic()
        if not intact:  # Redis lost the entry (restarted empty): the next beat sends the whole cache
            journal.lost()

    def take_prefix_changes(self, lost: bool = False) -> PrefixCacheChanges | None:
        """For the supervisor of an embedded registry, which indexes them (with Redis, the heartbeat does); `lost`:
        its last take never reached the index. None: no prefix cache, or not started."""
        if not self._ready.done() or (journal := self._engine.prefix_journal) is None:
            return None
        if lost:
            journal.lost()
        return journal.take()

    def stop(self, grace_s: float = 5.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._beat.set()  # the heartbeat deregisters now, not at its next beat
        if self._ready.done() and self._ready.exception() is None:
            asyncio.run_coroutine_threadsafe(self._shutdown(grace_s), self._loop).result(timeout=grace_s + 30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as e:
            log.exception("worker %s failed to start: %r", self.spec.worker_id, e)
            self._ready.set_exception(e)
            if self.spec.exit_on_fatal:  # after a grace, so the launcher's wait_ready reports the reason
                threading.Timer(EXIT_GRACE_S, self._exit_for_restart, [f"start failed: {e!r}"]).start()
            return
        self._loop.run_forever()

    def _engine_died(self, error: BaseException) -> None:
        """On the engine thread, as it dies: the rest happens on the server's loop."""
        self._fatal = error
        asyncio.run_coroutine_threadsafe(self._leave(error), self._loop)

    async def _leave(self, error: BaseException) -> None:
        """Out of service at once; in-flight calls (already failed by the engine) get their status; then exit.
        An engine that dies while the worker starts fails the start instead (`_run` reports it and exits)."""
        log.error("worker %s: engine thread died (%r); leaving service", self.worker_id, error)
        if not self._ready.done() or self._ready.exception() is not None:
            return
        try:
            await self._server.set_serving(False)
            self._stopped.set()  # the heartbeat deregisters and ends
            self._beat.set()
            if self._heartbeat_thread is not None:
                await asyncio.to_thread(self._heartbeat_thread.join, EXIT_GRACE_S)
            await self._server.stop(EXIT_GRACE_S)
        finally:
            if self.spec.exit_on_fatal:
                self._exit_for_restart(f"engine thread died: {error!r}")

    def _exit_for_restart(self, reason: str) -> None:
        log.error("worker %s exits for Ray to restart it: %s", self.worker_id, reason)
        sys.stderr.flush()
        os._exit(1)

    async def _start(self) -> None:
        from pdserve.addresses import PORT_SPAN, bind_first_free, join
        from pdserve.engine.async_engine import AsyncEngine
        from pdserve.engine.engine import LLMEngine
        from pdserve.engine.profiling import SpeedTracker
        from pdserve.metrics import WorkerMetrics
        from pdserve.rpc.server import Server

        spec = self.spec
        fail_first_start(spec.worker_id)
        self._engine = AsyncEngine(await asyncio.to_thread(LLMEngine, spec.engine_config()))
        self._engine.on_death = self._engine_died
        self._server = Server(
            spec.host,
            spec.port,
            self.telemetry.server_interceptors(),
            tls=internal_server_tls(),
            cluster=ClusterSecret.from_env(),
            inner=[self._gate],
            advertise_host=spec.advertise_host,
            port_span=PORT_SPAN,
        )
        engine = self._engine
        self._metrics = WorkerMetrics(self.telemetry.meter, spec.worker_id, spec.role, lambda: engine.stats)
        if spec.metrics_port is not None:
            port = bind_first_free(partial(self.telemetry.serve_metrics, spec.host), spec.metrics_port)
            self._metrics_address = join(spec.advertise_host, port)
        self._transfer = self._services(WorkerContext(spec, self._engine, self._server, self.telemetry, self._metrics))
        add_control_service(self._server, self._drain_here, spec.worker_id)
        await self._server.start()
        profile = slowed_profile(await self._engine.measure_profile(), spec.worker_id)  # first: it writes over the pool
        self._speed = SpeedTracker(profile)
        self._metrics.track_speed(lambda: self._speed.factor)
        await self._warm_up()
        self._engine.on_step = self._stepped
        self._engine.on_request_times = self._metrics.requests_timed  # after the warm-up: it is no request
        await self._server.set_serving(True)
        self._ready.set_result(self._server.address)
        self._recheck.start(self._engine, self._speed)
        if spec.registry_url:
            self._heartbeat_thread = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
            self._heartbeat_thread.start()

    def _stepped(
        self, prefill_tokens: int, decode_seqs: int, seconds: float, prefill_squares: int, decode_context: int
    ) -> None:
        """On the engine thread, each step that ran tokens: the live speed correction, and the step metrics."""
        self._speed.observe(prefill_tokens, decode_seqs, seconds, prefill_squares, decode_context)
        self._metrics.stepped(prefill_tokens + decode_seqs, seconds)

    async def _warm_up(self) -> None:
        """One tiny step through the model, so the first real request does not pay for lazy kernel set-up."""
        from pdserve.protocol.engine_request import EngineRequest
        from pdserve.protocol.sampling import SamplingParams

        if self.spec.role is Role.DECODE:
            return  # a decode-only engine takes no prompts; its first step is a decode
        request_id = f"warmup-{self.worker_id}"
        out = await self._engine.prefill(EngineRequest(request_id, [0, 1, 2, 3], SamplingParams(max_tokens=1)))
        if not out.finished:
            self._engine.release(request_id)

    async def _drain_here(self, timeout_s: float = 0.0) -> DrainReport:
        """On the server's loop: drains (or joins the drain under way) and reports how it ended; then the worker
        leaves. `timeout_s` 0: the spec's. (Not a public method: a Ray actor's callers would run it on Ray's loop.)"""
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_and_leave(timeout_s or self.spec.drain_timeout_s))
        return await asyncio.shield(self._drain)

    async def _drain_and_leave(self, timeout_s: float) -> DrainReport:
        engine = self._engine
        log.warning("worker %s draining: in-flight requests may take %g s, then move", self.worker_id, timeout_s)
        await self._server.set_serving(False)
        await self._recheck.stop()
        self._beat.set()  # with Redis, the entry says draining now, not at the next beat
        cut_wait_s = 2 * self.spec.kv_transfer_timeout_s + EXIT_GRACE_S  # a send's wait to start, then its bytes
        report = await run_drain(self._gate, lambda: engine.stats["kv_blocks_used"], timeout_s, cut_wait_s)
        log.warning(
            "worker %s drained in %.1f s: held %d requests (%d KV blocks); %d finished, %d moved; %d KV blocks left",
            *(self.worker_id, report.seconds, report.held, report.kv_blocks_held),
            *(report.finished, report.moved, report.kv_blocks_left),
            extra={"drain": asdict(report)},
        )
        self._stopped.set()
        self._beat.set()  # the heartbeat deregisters and ends
        if self._heartbeat_thread is not None:
            await asyncio.to_thread(self._heartbeat_thread.join, EXIT_GRACE_S)
        self._loop.call_later(EXIT_GRACE_S, self._leave_drained)  # after the Drain call's answer went out
        return report

    def _leave_drained(self) -> None:
        self._drained = True  # the supervisor replaces this worker now
        asyncio.ensure_future(self._shutdown(EXIT_GRACE_S))
        if self.spec.exit_on_fatal:
            threading.Timer(DRAINED_EXIT_S, self._exit_for_restart, ["drained, and no supervisor replaced it"]).start()

    def _drain_on_sigterm(self) -> None:
        """On the SIGTERM thread: a worker still starting just exits (no request reached it yet)."""
        try:
            self.address(timeout_s=0)
        except BaseException:
            self._exit_for_restart("SIGTERM before it served")
        asyncio.run_coroutine_threadsafe(self._drain_here(), self._loop).result()

    async def _shutdown(self, grace_s: float) -> None:
        await self._recheck.stop()
        await self._server.set_serving(False)
        await self._server.stop(grace_s)
        if self._transfer is not None:
            self._transfer.close()
        self._engine.stop()
        self.telemetry.shutdown()  # flushes spans still batched
        if self._heartbeat_thread is not None:  # gone from the registry (and its prefix index) once stopped
            await asyncio.to_thread(self._heartbeat_thread.join, EXIT_GRACE_S)
        self._loop.call_soon(self._loop.stop)

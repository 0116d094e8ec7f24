"""One worker process: its engine on the engine thread, its gRPC server on an asyncio loop thread.

The same class runs under Ray (as an actor) and in tests; its public methods are cheap and
thread-safe, so a Ray actor can answer health checks while the model runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, replace

from pdserve.config import EngineConfig
from pdserve.engine.device import resolve_device, resolve_dtype
from pdserve.engine.model_runner import kv_block_bytes
from pdserve.engine.profiling import SpeedTracker, measure_profile
from pdserve.protocol.roles import EngineMode
from pdserve.registry.base import WorkerState

log = logging.getLogger(__name__)

ROLE_MODES = {"prefill": EngineMode.PREFILL_ONLY, "decode": EngineMode.DECODE_ONLY, "colocated": EngineMode.MIXED}


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # prefill, decode or colocated
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = ""
    registry_url: str | None = None  # redis://...: heartbeat there; None: the launcher publishes for us
    heartbeat_s: float = 0.5
    metrics_port: int | None = 0  # Prometheus /metrics on this port (0: a free one, registered); None: none
    log_level: str | None = None  # set: this process logs structured lines at that level
    kv_transfer_timeout_s: float = 30.0  # decode side: a KV transfer not done by then fails, freeing its blocks

    def __post_init__(self) -> None:
        if self.role not in ROLE_MODES:
            raise ValueError(f"role must be one of {list(ROLE_MODES)}, got {self.role!r}")


class WorkerRuntime:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = replace(spec, worker_id=spec.worker_id or f"{spec.role}-{uuid.uuid4().hex[:8]}")
        from pdserve.telemetry import Telemetry, configure_logging

        if spec.log_level:
            configure_logging(spec.log_level, service=f"pdserve-{spec.role}")
        self.telemetry = Telemetry(f"pdserve-{spec.role}")
        self._metrics_address = ""
        self._ready: Future[str] = Future()
        self._loop = asyncio.new_event_loop()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-rpc", daemon=True)
        self._thread.start()

    def address(self, timeout_s: float = 600.0) -> str:
        """Blocks until the model is loaded, warmed up and the server reports SERVING."""
        return self._ready.result(timeout=timeout_s)

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    def fingerprint(self) -> str:
        self.address()
        return self._engine.engine.fingerprint

    def stats(self) -> dict[str, int]:
        self.address()
        return dict(self._engine.stats)

    def state(self) -> WorkerState:
        """What routers need to know of this worker now: identity, profile, load."""
        self.address()
        stats = self._engine.stats
        engine = self._engine.engine
        return WorkerState(
            worker_id=self.worker_id,
            role=self.spec.role,
            address=self._server.address,
            model_fingerprint=engine.fingerprint,
            block_size=engine.config.block_size,
            kv_bytes_per_token=self._kv_bytes_per_token,
            kv_blocks_total=stats["kv_blocks_total"],
            kv_blocks_free=stats["kv_blocks_total"] - stats["kv_blocks_used"],
            kv_blocks_cached=stats["kv_blocks_cached"],
            queued_prefill_tokens=stats["queued_prefill_tokens"],
            running=stats["running"],
            waiting=stats["waiting"],
            profile=self._speed.profile,
            speed_factor=self._speed.factor,
            metrics_address=self._metrics_address,
        )

    def _heartbeat(self) -> None:
        from pdserve.registry.redis import RedisRegistry

        assert self.spec.registry_url is not None
        registry = RedisRegistry(self.spec.registry_url, ttl_s=max(2.0, 6 * self.spec.heartbeat_s))
        while not self._stopped.wait(self.spec.heartbeat_s):
            try:
                registry.publish(self.state())
            except Exception as e:  # Redis down: keep serving, publish again when it is back
                log.warning("heartbeat to %s failed: %s", self.spec.registry_url, e)
        try:
            registry.remove(self.worker_id)
        except Exception as e:
            log.warning("could not deregister %s: %s", self.worker_id, e)

    def stop(self, grace_s: float = 5.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._ready.done() and self._ready.exception() is None:
            asyncio.run_coroutine_threadsafe(self._shutdown(grace_s), self._loop).result(timeout=grace_s + 30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as e:
            log.exception("worker %s failed to start", self.spec.worker_id)
            self._ready.set_exception(e)
            return
        self._loop.run_forever()

    async def _start(self) -> None:
        from pdserve.engine.async_engine import AsyncEngine
        from pdserve.engine.engine import LLMEngine
        from pdserve.metrics import WorkerMetrics
        from pdserve.rpc.server import Server

        spec = self.spec
        scheduler = replace(spec.engine.scheduler, mode=ROLE_MODES[spec.role])
        if spec.role == "prefill":
            # One prompt chunk per step, first come first served: batching later prompts into an earlier
            # one's step delays its first token past what admission promised it.
            scheduler = replace(scheduler, max_num_batched_tokens=scheduler.long_prefill_chunk)
        config = replace(spec.engine, scheduler=scheduler)
        if spec.role == "decode":
            # Every prompt block arrives from a prefill worker, so nothing a decode worker caches is ever
            # matched; uncached freed blocks stay free, and reservations stay whole runs (copy-free transfers).
            config = replace(config, enable_prefix_caching=False)
        engine = await asyncio.to_thread(LLMEngine, config)
        self._engine = AsyncEngine(engine)
        self._server = Server(spec.host, spec.port, self.telemetry.server_interceptors())
        self._metrics = WorkerMetrics(
            self.telemetry.meter,
            spec.worker_id,
            spec.role,
            lambda: self._engine.stats,
            lambda: engine.blocks.prefix_hits,
        )
        if spec.metrics_port is not None:
            port = self.telemetry.serve_metrics(spec.host, spec.metrics_port)
            self._metrics_address = f"{spec.host}:{port}"
        self._transfer = self._add_servicer(self._server, engine)
        await self._server.start()
        await self._warm_up()
        profile = await asyncio.to_thread(measure_profile, engine)
        self._speed = SpeedTracker(profile)
        self._engine.on_step = self._speed.observe
        self._kv_bytes_per_token = kv_block_bytes(engine.model_config, config.block_size, resolve_dtype(config)) // (
            config.block_size
        )
        await self._server.set_serving(True)
        self._ready.set_result(self._server.address)
        if spec.registry_url:
            threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()

    def _add_servicer(self, server: object, engine: object) -> object:
        """Services live outside this package; imported here, where the role is known."""
        from pdserve import env
        from pdserve.transfer.torch_dist import TorchDistReceiver, TorchDistSender
        from pdserve.v1 import worker_pb2, worker_pb2_grpc

        spec, device, fp = self.spec, resolve_device(self.spec.engine), engine.fingerprint  # type: ignore[attr-defined]
        names = worker_pb2.DESCRIPTOR.services_by_name
        if spec.role == "prefill":
            from services.prefill.servicer import PrefillServicer

            sender = TorchDistSender(spec.host, device=device, model_fingerprint=fp)
            servicer = PrefillServicer(
                self._engine, sender, spec.worker_id, self.telemetry, self._metrics, env.fault_config()
            )
            server.add(  # type: ignore[attr-defined]
                lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, s),
                [names["PrefillWorker"].full_name],
            )
            return sender
        from services.decode.servicer import DecodeServicer

        receiver = TorchDistReceiver(spec.host, device=device, model_fingerprint=fp) if spec.role == "decode" else None
        servicer = DecodeServicer(
            self._engine, receiver, spec.worker_id, spec.role, self.telemetry, spec.kv_transfer_timeout_s
        )
        server.add(  # type: ignore[attr-defined]
            lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, s),
            [names["DecodeWorker"].full_name],
        )
        return receiver

    async def _warm_up(self) -> None:
        """One tiny step through the model, so the first real request does not pay for lazy kernel set-up."""
        from pdserve.protocol.sampling import SamplingParams

        engine = self._engine
        if self.spec.role == "decode":
            return  # a decode-only engine takes no prompts; its first step is a decode
        params = SamplingParams(max_tokens=1)
        out = await engine.prefill(f"warmup-{self.worker_id}", [0, 1, 2, 3], params)
        if not out.finished:
            await engine.call(lambda e: e.release(f"warmup-{self.worker_id}"))

    async def _shutdown(self, grace_s: float) -> None:
        await self._server.set_serving(False)
        await self._server.stop(grace_s)
        if self._transfer is not None:
            self._transfer.close()  # type: ignore[attr-defined]
        self._engine.stop()
        self.telemetry.shutdown()  # flushes spans still batched
        self._loop.call_soon(self._loop.stop)

"""`pdserve up`: Ray-managed worker actors, the router in this process, drain and stop on a signal."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import replace
from typing import Any

from pdserve import env
from pdserve.cluster.factories import ClusterServices
from pdserve.cluster.supervisor import Slot, Supervisor
from pdserve.cluster.worker_runtime import EXIT_GRACE_S, WorkerRuntime
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import ClusterConfig
from pdserve.registry.base import PrefixIndex, Registry, WorkerState
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry

log = logging.getLogger(__name__)


class Cluster:
    def __init__(self, config: ClusterConfig, services: ClusterServices) -> None:
        self.config = config
        self.services = services
        self.registry: Registry
        self.prefix_index: PrefixIndex
        if config.redis_url:
            from pdserve.registry.redis import RedisPrefixIndex, RedisRegistry

            r = config.router
            self.registry = RedisRegistry(config.redis_url, max_view_age_s=r.registry_max_view_age_s)
            self.prefix_index = RedisPrefixIndex(config.redis_url, match_budget_s=r.prefix_match_budget_s)
        else:
            self.registry = InMemoryRegistry()
            self.prefix_index = InMemoryPrefixIndex()
        self.supervisor = Supervisor(self.registry, publish=not config.redis_url, new_actor=self._new_actor)
        self._actor_cls: Any = None
        self._started_ray = False

    def start_workers(self) -> None:
        import ray

        c = self.config
        if not ray.is_initialized():
            ray.init(
                address=c.ray_address,
                include_dashboard=False,
                num_cpus=None if c.ray_address else os.cpu_count(),
                object_store_memory=None if c.ray_address else 100 * 2**20,  # we pass no objects through it
                runtime_env={"env_vars": env.worker_env()},
                logging_level=logging.WARNING,
                log_to_driver=True,
            )
            self._started_ray = True
        engine = replace(c.engine, num_threads=c.threads_per_worker())
        gpus = 1 if _wants_gpu(engine.device) else 0
        self._actor_cls = ray.remote(WorkerRuntime).options(
            num_cpus=0, num_gpus=gpus, max_restarts=c.max_restarts, max_task_retries=0
        )
        for i, role in enumerate(c.roles):
            worker_id = f"{role}-{i}"
            spec = WorkerSpec(
                role,
                engine,
                c.host,
                0,
                worker_id,
                c.redis_url,
                c.router.heartbeat_s,
                log_level=c.log_level,
                kv_transfer_timeout_s=c.kv_transfer_timeout_s,
                exit_on_fatal=True,
            )
            self.supervisor.slots[worker_id] = Slot(spec, self._new_actor(spec))
        for worker_id, slot in self.supervisor.slots.items():
            state = self._await_start(slot)
            self.registry.publish(state)
            slot.listed, slot.address = True, state.address
            log.info("worker %s ready at %s", worker_id, state.address)
            log.info("worker %s metrics at %s", worker_id, state.metrics_address)

    def _new_actor(self, spec: WorkerSpec) -> Any:
        return self._actor_cls.remote(spec, self.services.workers)

    def _await_start(self, slot: Slot) -> WorkerState:
        """The worker's state once it serves. A failed start is logged with its reason, and Ray restarts the
        worker (it exits); when its restarts are used up, `pdserve up` fails instead of waiting forever."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        worker_id, failures, died = slot.spec.worker_id, 0, 0
        while True:
            try:
                ray.get(slot.actor.wait_ready.remote())
                return ray.get(slot.actor.state.remote())
            except ActorUnavailableError:  # Ray is restarting it
                time.sleep(0.5)
            except RayActorError as e:  # its process died; twice in a row at once: dead for good
                died += 1
                log.error("worker %s died while starting: %s", worker_id, _reason(e))
                if died >= 2:
                    raise RuntimeError(f"worker {worker_id} could not be started: {_reason(e)}") from e
            except Exception as e:  # its start failed with this reason; it exits and Ray restarts it
                died, failures = 0, failures + 1
                log.error("worker %s failed to start (attempt %d): %s", worker_id, failures, _reason(e))
                if failures > self.config.max_restarts:
                    raise RuntimeError(f"worker {worker_id} failed to start {failures} times: {_reason(e)}") from e
                time.sleep(2 * EXIT_GRACE_S)  # until the failed process is gone, not to ask it again

    async def watch(self) -> None:
        """Supervises the worker actors until cancelled (see `Supervisor`)."""
        await self.supervisor.run(self.config.router.heartbeat_s)

    def stop_workers(self) -> None:
        import ray

        for slot in self.supervisor.slots.values():
            try:
                ray.get(slot.actor.stop.remote(), timeout=30)
            except Exception as e:  # dead already, or stuck: killed below either way
                log.warning("worker did not stop cleanly: %r", e)
            ray.kill(slot.actor, no_restart=True)
        self.supervisor.slots.clear()
        if self._started_ray:
            ray.shutdown()


async def run_cluster(config: ClusterConfig, services: ClusterServices, ready_line: bool = True) -> None:
    from pdserve.metrics import SupervisionMetrics
    from pdserve.telemetry import Telemetry

    env.ensure_cluster_secret()  # before Ray starts: the workers inherit it
    if config.internal_tls_cert and config.internal_tls_key and config.internal_tls_ca:
        env.export_internal_tls(config.internal_tls_cert, config.internal_tls_key, config.internal_tls_ca)
    cluster = Cluster(config, services)
    try:
        await asyncio.to_thread(cluster.start_workers)
    except BaseException:  # a worker that cannot start: stop the others rather than leave them running
        await asyncio.to_thread(cluster.stop_workers)
        raise
    telemetry = Telemetry("pdserve-router")
    cluster.supervisor.on_replaced = SupervisionMetrics(telemetry.meter).replaced
    await cluster.registry.start()
    c = config
    server, router = await services.router(
        c.engine.model,
        cluster.registry,
        cluster.prefix_index,
        c.router,
        c.host,
        c.port,
        telemetry,
        http_port=c.http_port,
    )
    if server.http is not None:
        log.info("router OpenAI-compatible HTTP API at http://%s/v1", server.http.address)
    if config.metrics_port is not None:
        port = telemetry.serve_metrics(config.host, config.metrics_port)
        log.info("router metrics at http://%s:%d/metrics", config.host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(cluster.watch())
    if ready_line:
        print(f"ready {server.address} ({config.mode}: {', '.join(config.roles)})", flush=True)
    try:
        await stop.wait()
    finally:
        watcher.cancel()
        log.info("draining")
        router.draining = True
        await server.set_serving(False)
        deadline = loop.time() + config.drain_grace_s
        while router.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.1)
        await server.stop(1.0)
        await cluster.prefix_index.close()
        await cluster.registry.close()
        await asyncio.to_thread(cluster.stop_workers)
        telemetry.shutdown()


def _reason(e: BaseException) -> str:
    """An actor's own exception without Ray's traceback around it."""
    e = getattr(e, "cause", None) or e
    return (str(e).strip() or repr(e)).splitlines()[0][:500]


def _wants_gpu(device: str) -> bool:
    """Whether a worker gets a GPU, decided from Ray's view of the cluster rather than torch's, so that the
    launcher (the router's process) never imports torch: "auto" means CUDA wherever Ray found GPUs."""
    import ray

    if device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return device.startswith("cuda")

"""`pdserve up`: Ray-managed worker actors, the router in this process, drain and stop on a signal."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import replace

from pdserve import env
from pdserve.cluster.factories import ClusterServices
from pdserve.cluster.worker_runtime import WorkerRuntime
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import ClusterConfig
from pdserve.registry.base import PrefixIndex, Registry
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
        self._actors: dict[str, object] = {}
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
        actor_cls = ray.remote(WorkerRuntime).options(
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
            )
            self._actors[worker_id] = actor_cls.remote(spec, self.services.workers)
        for worker_id, actor in self._actors.items():
            state = ray.get(actor.state.remote())
            self.registry.publish(state)
            log.info("worker %s ready at %s", worker_id, state.address)
            log.info("worker %s metrics at %s", worker_id, state.metrics_address)

    async def watch(self) -> None:
        """The embedded registry's heartbeat: publishes each actor's state; a dead one leaves placement, a
        restarted one rejoins. With Redis the workers publish themselves and the TTL drops the dead."""
        from ray.exceptions import RayActorError

        interval = self.config.router.heartbeat_s
        while True:
            await asyncio.sleep(interval)
            if self.config.redis_url:
                continue
            for worker_id, actor in self._actors.items():
                try:
                    state = await asyncio.wait_for(actor.state.remote(), timeout=max(interval, 1.0))
                except RayActorError:  # dead or restarting: out of placement until it answers again
                    self.registry.remove(worker_id)
                    continue
                except TimeoutError:  # busy, not dead: its last state stands until the registry's TTL
                    log.warning("worker %s heartbeat late", worker_id)
                    continue
                self.registry.publish(state)

    def stop_workers(self) -> None:
        import ray

        for actor in self._actors.values():
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception as e:  # dead already, or stuck: killed below either way
                log.warning("worker did not stop cleanly: %r", e)
            ray.kill(actor, no_restart=True)
        self._actors.clear()
        if self._started_ray:
            ray.shutdown()


async def run_cluster(config: ClusterConfig, services: ClusterServices, ready_line: bool = True) -> None:
    from pdserve.telemetry import Telemetry

    cluster = Cluster(config, services)
    await asyncio.to_thread(cluster.start_workers)
    telemetry = Telemetry("pdserve-router")
    await cluster.registry.start()
    server, router = await services.router(
        config.engine.model, cluster.registry, cluster.prefix_index, config.router, config.host, config.port, telemetry
    )
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


def _wants_gpu(device: str) -> bool:
    """Whether a worker gets a GPU, decided from Ray's view of the cluster rather than torch's, so that the
    launcher (the router's process) never imports torch: "auto" means CUDA wherever Ray found GPUs."""
    import ray

    if device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return device.startswith("cuda")

"""The router's side of a process: its registry view, its servers (public gRPC, metrics), and its drain.

`pdserve router` runs only this, reading the workers from Redis (several routers may); `pdserve up` runs it beside
the worker fleet with the embedded registry.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
from dataclasses import dataclass

from pdserve.addresses import advertised_host, join, release_held
from pdserve.cluster.factories import RouterHandle, RouterServer, StartRouter
from pdserve.cluster.internal_security import prepare_internal_security
from pdserve.config import ClusterConfig
from pdserve.redaction import redacted_url
from pdserve.registry.base import PrefixIndex, Registry
from pdserve.telemetry import Telemetry

log = logging.getLogger(__name__)
CUT_WAIT_S = 1.0  # past the grace: how long the streams cut get to tell their callers why before the server stops


def registry_for(config: ClusterConfig) -> tuple[Registry, PrefixIndex]:
    """Redis when a URL is given (shared by every router), else the in-process registry of a one-router cluster."""
    if config.redis_url:
        from pdserve.registry.redis import RedisRegistry
        from pdserve.registry.redis_prefix import RedisPrefixIndex

        r = config.router
        registry = RedisRegistry(config.redis_url, max_view_age_s=r.registry_max_view_age_s or math.inf)
        return registry, RedisPrefixIndex(config.redis_url, match_budget_s=r.prefix_match_budget_s)
    from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry

    return InMemoryRegistry(), InMemoryPrefixIndex()


@dataclass
class RunningRouter:
    server: RouterServer
    handle: RouterHandle
    registry: Registry
    prefix_index: PrefixIndex

    async def drain_and_stop(self, grace_s: float) -> None:
        """NOT_SERVING, in-flight streams finish within `grace_s`, then the server and the registry view stop."""
        log.info("draining")
        self.handle.draining = True
        await self.server.set_serving(False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.handle.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.1)
        if self.handle.in_flight:
            why = f"the router stopped: its drain's grace of {grace_s:g} s ran out; retry on another replica"
            cut = self.handle.relay.cut_all(why)
            log.warning("drain grace of %g s ran out; streams still open, cut with UNAVAILABLE: %d", grace_s, cut)
            deadline = loop.time() + CUT_WAIT_S
            while self.handle.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)
        await self.server.stop(1.0)
        await self.prefix_index.close()
        await self.registry.close()


async def start_router_process(
    config: ClusterConfig,
    start_router: StartRouter,
    registry: Registry,
    prefix_index: PrefixIndex,
    telemetry: Telemetry,
) -> RunningRouter:
    """The router serving on `config.host:port` (advertised on `config.advertise_host`), its metrics too."""
    await registry.start()
    host = advertised_host(config.host, config.advertise_host)
    c = config
    release_held()  # the ports the command held since its start: its listeners bind them now
    server, handle = await start_router(
        c.engine.model, registry, prefix_index, c.router, c.host, c.port, telemetry, host, http_port=c.http_port
    )
    if server.http is not None:
        scheme = "https" if c.router.tls_cert else "http"  # the HTTP API serves the gRPC port's certificate
        log.info("router OpenAI-compatible HTTP API at %s://%s/v1", scheme, join(host, server.http.port))
    if config.metrics_port is not None:
        port = telemetry.serve_metrics(config.host, config.metrics_port)
        log.info("router metrics at http://%s/metrics", join(host, port))
    return RunningRouter(server, handle, registry, prefix_index)


def stop_signal(stop: asyncio.Event | None = None) -> asyncio.Event:
    """`stop` (a new event if None), set on SIGINT or SIGTERM from now on, which no longer end the process at once.
    Taken before a process starts anything a signal must stop, and again after `ray.init`: Ray's driver installs a
    SIGTERM handler of its own over what was there (it prints a stack trace; a `pdserve up` whose handler came
    before it ended by SIGABRT after its drain)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def run_router(config: ClusterConfig, start_router: StartRouter) -> None:
    """`pdserve router`: serves from the Redis registry until SIGTERM, then drains."""
    stop = stop_signal()
    prepare_internal_security(config, make_secret=False)
    telemetry = Telemetry("pdserve-router")
    registry, prefix_index = registry_for(config)
    if not await _registry_answers(registry, config, stop):
        await registry.close()
        return
    router = await start_router_process(config, start_router, registry, prefix_index, telemetry)
    workers = len(registry.workers())
    print(f"ready {router.server.address} (router; {workers} workers in the registry)", flush=True)
    try:
        await stop.wait()
    finally:
        await router.drain_and_stop(config.drain_grace_s)
        telemetry.shutdown()


async def _registry_answers(registry: Registry, config: ClusterConfig, stop: asyncio.Event) -> bool:
    """Waits, not listening, until the registry has answered once (False: stopped first). A router that never had
    a view knows no worker: serving, it passed its health check and failed every request it was sent (an HA
    review's router started before its Redis); unready, its load balancer sends them to the others. One that had
    a view serves on from it through a later outage."""
    await registry.start()  # its first read; the view's refresh goes on in the background
    if registry.view_current():
        return True
    log.warning(
        "registry redis at %s does not answer: waiting for it before serving", redacted_url(config.redis_url or "")
    )
    while not registry.view_current():
        if stop.is_set():
            return False
        await asyncio.sleep(0.1)
    log.info("registry redis answers: %d workers listed", len(registry.workers()))
    return True

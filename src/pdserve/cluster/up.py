"""`pdserve up`: the one-command local cluster, the worker fleet and a router in one process around the embedded
registry (or Redis). It stops everything it started on SIGINT/SIGTERM. Joined to a Ray cluster (`--ray-address`),
its actors are detached in the Ray namespace, so a SIGKILLed `pdserve up` leaves them serving for a
`pdserve router` (with Redis) or a `pdserve controller` to find. There, a Ray connection lost for good (the Ray
head restarted) ends supervision. With Redis the router serves on (the workers publish there themselves) while
it joins Ray again and takes up the workers, as a start does; with its own registry, which cannot keep a worker
listed without Ray, it drains the router and exits with an error, so that whatever runs it starts a new one,
which finds the actors again.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.background import cancel_and_wait
from pdserve.cluster.factories import ClusterServices
from pdserve.cluster.internal_security import prepare_internal_security
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.router_process import registry_for, start_router_process, stop_signal
from pdserve.config import ClusterConfig
from pdserve.registry.memory import InMemoryPrefixIndex

log = logging.getLogger(__name__)


async def run_cluster(config: ClusterConfig, services: ClusterServices, ready_line: bool = True) -> None:
    from pdserve.metrics import SupervisionMetrics
    from pdserve.telemetry import Telemetry

    # Before Ray starts: the workers inherit it. Joined to a Ray cluster, its detached workers outlive this process,
    # so the secret must be the operator's, shared with whichever router takes them over.
    prepare_internal_security(config, make_secret=config.ray_address is None)
    registry, prefix_index = registry_for(config)
    # Embedded, the supervisor takes the workers' prefix-cache journals into the index; with Redis they write it.
    journals_to = prefix_index if isinstance(prefix_index, InMemoryPrefixIndex) else None
    cluster = Cluster(config, services.workers, registry, publish=not config.redis_url, prefix_index=journals_to)
    stop = stop_signal()  # from here on, a signal ends the start cleanly
    if not await cluster.connect_until(stop):
        return
    stop_signal(stop)  # back from Ray, whose SIGTERM handler replaced it
    # A worker that cannot start, or a signal while they start: the others are stopped, not left running.
    if not await cluster.start_until(stop, cluster.stop_workers, fail_fast=True):
        return
    telemetry = Telemetry("pdserve-router")
    cluster.supervisor.on_replaced = SupervisionMetrics(telemetry.meter, config.roles).replaced
    try:
        router = await start_router_process(config, services.router, registry, prefix_index, telemetry)
    except BaseException:  # its port taken since the check, say: the workers are not left running
        await asyncio.to_thread(cluster.stop_workers)
        raise
    if ready_line:
        print(f"ready {router.server.address} ({config.mode}: {', '.join(config.roles)})", flush=True)
    link_lost = False
    try:
        while not await cluster.supervise_until(stop):
            if not config.redis_url:
                link_lost = True
                break
            # The workers publish to Redis themselves, so the router serves on; only supervision is gone.
            log.error(
                "lost the connection to the Ray cluster at %s (its head restarted or is gone): the router serves on "
                "from Redis, unsupervised until Ray answers again",
                config.ray_address,
            )
            if not await cluster.rejoin(stop):
                break
            log.info("joined the Ray cluster at %s again: supervising its workers", config.ray_address)
    finally:
        # The router's drain needs its workers listed: its streams' retries and moves, an admitted request's later
        # choices. Embedded, only the supervisor's checks keep them so; without them they drop out DEFAULT_TTL_S in.
        listing = None if link_lost else asyncio.create_task(cluster.supervisor.run(config.router.heartbeat_s))
        try:
            await router.drain_and_stop(config.drain_grace_s)
        finally:
            await cancel_and_wait(listing)
        if not link_lost and cluster.actors.connected():  # through Ray, which still answers
            await asyncio.to_thread(cluster.stop_workers)
        telemetry.shutdown()
    if link_lost:
        raise ConnectionError(
            f"lost its connection to the Ray cluster at {config.ray_address} (its head restarted or is gone); "
            "exiting so that it is restarted: no worker can stay listed in its own registry without Ray; the "
            "worker actors keep serving, and the next pdserve up finds them"
        )

"""`pdserve controller`: the worker fleet in a Ray cluster, apart from any router.

It waits for its Redis, joins Ray, creates the worker actors (or finds them again in its Ray namespace after its
own restart), supervises them, and has them publish to Redis, where routers find them. On SIGTERM it leaves the
actors serving (they are detached) unless told to stop them: a controller's restart is not a fleet's. A Ray Client
connection lost for good (the Ray head restarted) ends it with an error, so that its Deployment starts a new one,
which connects once the head is back and finds the actors (those that outlived the head, with GCS fault tolerance).
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.addresses import release_held
from pdserve.cluster.factories import ClusterServices
from pdserve.cluster.internal_security import prepare_internal_security
from pdserve.cluster.launcher import JOIN_WINDOW_S, Cluster
from pdserve.cluster.liveness import SupervisionLiveness
from pdserve.cluster.router_process import stop_signal
from pdserve.config import ClusterConfig

log = logging.getLogger(__name__)


async def run_controller(config: ClusterConfig, services: ClusterServices) -> None:
    from pdserve.metrics import SupervisionMetrics
    from pdserve.registry.redis import RedisRegistry
    from pdserve.registry.redis_reachable import wait_until_answers
    from pdserve.telemetry import HEALTH_PATH, Telemetry

    if not config.redis_url or not config.ray_address:
        raise ValueError("pdserve controller needs --redis and --ray-address")
    prepare_internal_security(config, make_secret=False)  # before Ray connects: the workers inherit it
    cluster = Cluster(config, services.workers, RedisRegistry(config.redis_url), publish=False)
    stop = stop_signal()  # from here on, a signal ends the start cleanly
    # Its Redis first (a PING, where joining Ray takes seconds and starts no worker), then Ray, in one window: a
    # Redis pod up after this one is waited for, and a URL naming no Redis ends the start, not the workers' first
    # publish after Ray was joined.
    deadline = time.monotonic() + JOIN_WINDOW_S
    if not await wait_until_answers(config.redis_url, stop, deadline, before="joining Ray"):
        return
    if not await cluster.connect_until(stop, retry_join=True, deadline=deadline):
        return
    stop_signal(stop)  # back from Ray, whose SIGTERM handler replaced it
    end = cluster.stop_workers if config.stop_workers_on_exit else cluster.leave_workers
    if not await cluster.start_until(stop, end):
        return
    telemetry = Telemetry("pdserve-controller")
    cluster.supervisor.on_replaced = SupervisionMetrics(telemetry.meter, config.roles).replaced
    if config.metrics_port is not None:
        release_held()  # the port the command held since its start
        liveness = SupervisionLiveness(cluster.supervisor, cluster.check_interval_s)
        port = telemetry.serve_metrics(config.host, config.metrics_port, health=liveness.problem)
        log.info("controller metrics at http://%s:%d/metrics, liveness at %s", config.host, port, HEALTH_PATH)
    roles = ", ".join(config.roles)
    print(f"ready controller ({config.mode}: {roles}) in Ray namespace {config.ray_namespace}", flush=True)
    link_lost = False
    try:
        link_lost = not await cluster.supervise_until(stop)
    finally:
        if not link_lost:  # a stop (or an error here): leave or stop the workers through Ray, which still answers
            await asyncio.to_thread(end)
        telemetry.shutdown()
    if link_lost:
        raise ConnectionError(
            f"lost its connection to the Ray cluster at {config.ray_address} (its head restarted or is gone); "
            "exiting so that it is restarted: the worker actors keep serving, and the next controller finds them"
        )

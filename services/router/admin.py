"""The Admin service: the router's view of the cluster for `pdserve status`, `pdserve drain` and `pdserve scale`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.drain import check_drain_timeout
from pdserve.errors import UnavailableError
from pdserve.protocol.roles import Role
from pdserve.registry.base import Registry, WorkerState
from pdserve.rpc.server import internal_channel
from pdserve.v1 import admin_pb2 as apb
from pdserve.v1 import admin_pb2_grpc
from services.router.admin_audit import audited
from services.router.admitted import ClusterAdmitted
from services.router.caller_host import peer_host
from services.router.drain import DrainOutcome, drain_targets, drain_workers
from services.router.lifecycle import RequestLifecycle
from services.router.recent_latencies import RecentLatencies
from services.router.scale import scale_target

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 1.0
DRAIN_ONLY = frozenset({"DrainWorkers"})  # a key of this right alone drains only the host it calls from
T = TypeVar("T")


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, registry: Registry, router: RequestLifecycle, admitted: ClusterAdmitted) -> None:
        self.registry = registry
        self.admitted = admitted  # the cluster's, every router's
        self.recent = router.recent
        self.router = router  # also its in-flight count and draining flag

    async def ClusterStatus(  # noqa: N802 (gRPC method name)
        self, request: apb.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> apb.ClusterStatusResponse:
        with audited("ClusterStatus", context, "") as call:
            call.caller(self.router.authenticate(context.invocation_metadata())).check_admin("ClusterStatus")
            return await self._status()

    async def _status(self) -> apb.ClusterStatusResponse:
        workers = sorted(self.registry.workers(), key=lambda w: (w.role, w.worker_id))
        health = await asyncio.gather(*(_health(w.address) for w in workers))
        desired, (admitted, cluster_wide) = await self._desired(), await self.admitted.totals()
        return apb.ClusterStatusResponse(
            workers=[worker_status(w, h, self.recent) for w, h in zip(workers, health, strict=True)],
            in_flight=self.router.in_flight,
            draining=self.router.draining,
            desired={str(r): n for r, n in desired.items()},
            admitted_requests=admitted.requests,
            admitted_prompt_tokens=admitted.prompt_tokens,
            admitted_max_tokens=admitted.max_tokens,
            finished_requests=admitted.finished,
            completion_tokens=admitted.completion_tokens,
            admitted_local_only=not cluster_wide,
            shed_requests=admitted.shed,
            shed_prompt_tokens=admitted.shed_prompt_tokens,
            model=self.router.served_model,
            tokenizer=self.router.tokenizer.digest,
        )

    async def _desired(self) -> dict[Role, int]:
        """The registry's desired counts; none when it cannot answer now (the status shows the workers anyway)."""
        try:
            return await asyncio.to_thread(self.registry.desired_counts)
        except Exception as e:  # Redis down: the workers' view still comes from the router's last one
            log.warning("desired worker counts unknown: %r", e)
            return {}

    async def ScaleWorkers(  # noqa: N802 (gRPC method name)
        self, request: apb.ScaleWorkersRequest, context: grpc.aio.ServicerContext
    ) -> apb.ScaleWorkersResponse:
        asked = {Role.PREFILL: request.prefill, Role.DECODE: request.decode, Role.COLOCATED: request.colocated}
        with audited("ScaleWorkers", context, _counts({r: n for r, n in asked.items() if n})) as call:
            call.caller(self.router.authenticate(context.invocation_metadata())).check_admin("ScaleWorkers")
            return await self._scale(asked)

    async def _scale(self, asked: dict[Role, int]) -> apb.ScaleWorkersResponse:
        current = await _registry_call(self.registry.desired_counts)
        target = scale_target(asked, current, {w.role for w in self.registry.workers()})
        merged = False
        if set(current) == set(target):  # only the roles given change: a scale of another role meanwhile holds
            merged = await _registry_call(self.registry.merge_desired_counts, {r: n for r, n in asked.items() if n})
            if not merged:  # the counts went since they were read (a Redis restarted empty): every role's, or a retry
                target = scale_target(asked, {}, {w.role for w in self.registry.workers()})
        if merged:
            target = await _registry_call(self.registry.desired_counts) or target  # with such a scale's roles
        else:
            await _registry_call(self.registry.set_desired_counts, target)
        log.warning("desired worker counts %s -> %s", _counts(current), _counts(target))
        return apb.ScaleWorkersResponse(
            previous={str(r): n for r, n in current.items()}, desired={str(r): n for r, n in target.items()}
        )

    async def DrainWorkers(  # noqa: N802 (gRPC method name)
        self, request: apb.DrainWorkersRequest, context: grpc.aio.ServicerContext
    ) -> apb.DrainWorkersResponse:
        asked = f"host {request.host}" if request.host else f"workers {', '.join(request.worker_ids) or '(none)'}"
        with audited("DrainWorkers", context, f"{asked}, timeout {request.timeout_s:g} s") as call:
            tenant = call.caller(self.router.authenticate(context.invocation_metadata()))
            tenant.check_admin("DrainWorkers")
            check_drain_timeout(request.timeout_s)
            # A worker pod's preStop key (drain only) drains its own pod's workers: every pod holds it.
            own_host = peer_host(context.peer()) if tenant.admin_calls == DRAIN_ONLY else None
            workers = drain_targets(self.registry, list(request.worker_ids), request.host, own_host)
        ejections, interceptors = self.router.placement.ejections, self.router.telemetry.client_interceptors()
        outcomes = await drain_workers(workers, request.timeout_s, ejections, interceptors)
        return apb.DrainWorkersResponse(workers=[_drained(o) for o in outcomes])


def worker_status(w: WorkerState, health: str, recent: RecentLatencies) -> apb.WorkerStatus:
    """One worker's row; a latency without a recent sample stays unset (`-` and null to `pdserve status`)."""
    latencies: dict[str, float] = {}
    for kind in ("ttft", "tpot"):
        if (quantiles := recent.quantiles(w.worker_id, kind)) is not None:
            latencies[f"{kind}_p50_ms"], latencies[f"{kind}_p99_ms"] = (q * 1e3 for q in quantiles)
    return apb.WorkerStatus(
        id=w.worker_id,
        role=w.role,
        address=w.address,
        health=health,
        running=w.running,
        waiting=w.waiting,
        queued_prefill_tokens=w.queued_prefill_tokens,
        kv_blocks_used=w.kv_blocks_used,
        kv_blocks_cached=w.kv_blocks_cached,
        kv_blocks_total=w.kv_blocks_total,
        **latencies,
        metrics_address=w.metrics_address,
        state_age_s=max(0.0, time.monotonic() - w.heard_at),  # this process's clock only: the worker's may be off
        pid=w.pid,
        draining=w.draining,
        build=w.build,
        features=w.features,
        kv_wire_version=w.speaks_kv_wire_version,
        tokenizer=w.tokenizer,
        speed_factor=w.speed_factor,
    )


def _drained(o: DrainOutcome) -> apb.WorkerDrain:
    msg = apb.WorkerDrain(id=o.worker.worker_id, address=o.worker.address, drained=o.report is not None, error=o.error)
    if o.report is not None:
        report = asdict(o.report)
        del report["worker_id"]  # the message's `id`
        msg.MergeFrom(apb.WorkerDrain(**report))
    return msg


async def _registry_call(fn: Callable[..., T], *args: Any) -> T:
    """A blocking registry call off the loop; a registry that cannot answer (Redis down) is UNAVAILABLE."""
    try:
        return await asyncio.to_thread(fn, *args)
    except Exception as e:
        raise UnavailableError(f"the registry did not answer: {e!r}") from e


def _counts(counts: dict[Role, int]) -> str:
    return ", ".join(f"{n} {r}" for r, n in counts.items()) or "none"


async def _health(address: str) -> str:
    try:
        async with internal_channel(address) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S
            )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.aio.AioRpcError:
        return "UNREACHABLE"

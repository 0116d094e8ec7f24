"""`pdserve drain` as the router runs it: find the named workers (or every worker on a host) in the registry, take
them out of this router's placement at once, and ask each to drain (WorkerControl `Drain`), all at once. Other
routers stop placing on them when the registry shows them draining. Each worker's answer says how its drain ended;
one that cannot be reached is reported, not raised, so the others' reports still come back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import grpc

from pdserve.addresses import host_of
from pdserve.cluster.drain import DrainReport
from pdserve.errors import InvalidRequestError, PermissionDeniedError
from pdserve.registry.base import Registry, WorkerState
from pdserve.rpc.server import internal_channel
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc
from services.router.caller_host import canonical
from services.router.ejection import Ejections

log = logging.getLogger(__name__)
# Past the drain's own timeout: cut streams' cleanup (a KV send ends by its deadline) and the free of the blocks.
ANSWER_SLACK_S = 90.0


@dataclass(frozen=True)
class DrainOutcome:
    worker: WorkerState
    report: DrainReport | None  # None: it did not drain, for `error`
    error: str = ""


def drain_targets(
    registry: Registry, worker_ids: list[str], host: str, caller_host: str | None = None
) -> list[WorkerState]:
    """The workers named, or every worker whose address has `host`; bad input is INVALID_ARGUMENT. `caller_host`:
    the one host whose workers the caller may drain (a drain-only key's, the host it calls from; None: any). Another
    host, or ids of no worker there, registered elsewhere or not at all, are PERMISSION_DENIED alike, so such a
    caller learns nothing of other hosts' workers."""
    if bool(worker_ids) == bool(host):
        raise InvalidRequestError("worker_ids", "name the workers to drain, or a host, not both or neither")
    workers = {w.worker_id: w for w in registry.workers()}
    if caller_host is not None:
        why = f"a drain-only API key may drain only the workers of the host it calls from ({caller_host or 'none'})"
        if host and canonical(host) != caller_host:
            raise PermissionDeniedError("host", f"{why}, not those of {host}")
        workers = {i: w for i, w in workers.items() if canonical(host_of(w.address)) == caller_host}
        if elsewhere := sorted(set(worker_ids) - set(workers)):
            raise PermissionDeniedError("worker_ids", f"{why}; not there: {', '.join(elsewhere)}")
    if host:
        return [w for w in workers.values() if host_of(w.address) == host.strip("[]")]
    unknown = sorted(set(worker_ids) - set(workers))
    if unknown:
        raise InvalidRequestError("worker_ids", f"not registered: {', '.join(unknown)} (see `pdserve status`)")
    return [workers[i] for i in dict.fromkeys(worker_ids)]


async def drain_workers(
    workers: list[WorkerState], timeout_s: float, ejections: Ejections, interceptors: Sequence[Any] = ()
) -> list[DrainOutcome]:
    """`interceptors`: the router's tracing client interceptors, so that each worker's drain is in the trace of the
    Admin call that asked for it (without them, a trace of its own)."""
    for w in workers:
        ejections.eject(w, "draining")
    return list(await asyncio.gather(*(_drain(w, timeout_s, interceptors) for w in workers)))


async def _drain(worker: WorkerState, timeout_s: float, interceptors: Sequence[Any]) -> DrainOutcome:
    log.warning("draining worker %s at %s", worker.worker_id, worker.address)
    try:
        async with internal_channel(worker.address, interceptors) as ch:
            r = await worker_pb2_grpc.WorkerControlStub(ch).Drain(
                wpb.DrainRequest(timeout_s=timeout_s), timeout=timeout_s + ANSWER_SLACK_S
            )
    except grpc.aio.AioRpcError as e:
        log.error("worker %s did not drain: %s", worker.worker_id, e.details())
        return DrainOutcome(worker, None, f"{e.code().name}: {e.details()}")
    return DrainOutcome(worker, DrainReport(**{f.name: getattr(r, f.name) for f in fields(DrainReport)}))

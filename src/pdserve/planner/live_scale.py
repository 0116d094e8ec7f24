"""`pdserve scale --addr` and `pdserve autoscale` as a router's Admin client: the cluster's desired and serving
worker counts, ScaleWorkers, and the wait until the counts serve.

The router records the counts in the registry and answers at once; the fleet then starts workers (each enters
placement once warmed up) or drains them. So "scaled" is what `pdserve status` shows: per role, as many workers
SERVING and not draining as desired, and no more.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc

from pdserve.rpc.credentials import ClientCredentials
from pdserve.rpc.errors import retry_after_ms
from pdserve.rpc.server import channel
from pdserve.v1 import admin_pb2 as apb
from pdserve.v1 import admin_pb2_grpc

Counts = dict[str, int]  # role -> workers
POLL_S = 0.5


async def cluster_status(
    addr: str, credentials: ClientCredentials, timeout_s: float = 10.0
) -> apb.ClusterStatusResponse:
    async with channel(addr, credentials=credentials) as ch:
        return await admin_pb2_grpc.AdminStub(ch).ClusterStatus(
            apb.ClusterStatusRequest(), timeout=timeout_s, metadata=credentials.metadata()
        )


async def scale_workers(
    addr: str, credentials: ClientCredentials, counts: Counts, timeout_s: float = 10.0
) -> apb.ScaleWorkersResponse:
    """The router's answer; a RESOURCE_EXHAUSTED (the registry lost its counts until the fleet writes them back) is
    asked again after its retry hint, while `timeout_s` allows."""
    request = apb.ScaleWorkersRequest(**counts)  # a role's field name is the role
    deadline = time.monotonic() + timeout_s
    async with channel(addr, credentials=credentials) as ch:
        while True:
            try:
                return await admin_pb2_grpc.AdminStub(ch).ScaleWorkers(
                    request, timeout=deadline - time.monotonic(), metadata=credentials.metadata()
                )
            except grpc.aio.AioRpcError as e:
                shed = e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                hint_ms = retry_after_ms(e.trailing_metadata()) if shed else None
                if hint_ms is None or time.monotonic() + hint_ms / 1e3 >= deadline:
                    raise
                await asyncio.sleep(hint_ms / 1e3)


def serving_counts(status: apb.ClusterStatusResponse) -> Counts:
    """Per role, the workers that take requests now: SERVING and not draining."""
    return dict(Counter(w.role for w in status.workers if w.health == "SERVING" and not w.draining))


def all_counts(status: apb.ClusterStatusResponse) -> Counts:
    """Per role, every worker the router sees, draining ones too."""
    return dict(Counter(w.role for w in status.workers))


def settled(status: apb.ClusterStatusResponse, desired: Counts) -> bool:
    """Each role's desired count serves, and no worker of its beyond them is still draining away (the roles
    `desired` names: another scale may set the others meanwhile)."""
    serving, listed = serving_counts(status), all_counts(status)
    return all(serving.get(role, 0) == n == listed.get(role, 0) for role, n in desired.items())


async def wait_settled(
    addr: str, credentials: ClientCredentials, desired: Counts, timeout_s: float
) -> apb.ClusterStatusResponse:
    """The first status in which `desired` serves; TimeoutError with the last one's counts after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while True:
        status = await cluster_status(addr, credentials)
        if settled(status, desired):
            return status
        if time.monotonic() > end:
            raise TimeoutError(f"after {timeout_s:g} s serving {format_counts(serving_counts(status))}")
        await asyncio.sleep(POLL_S)


def format_counts(counts: Counts) -> str:
    """`2 prefill, 1 decode`, roles in the cluster's order."""
    order = {"prefill": 0, "decode": 1, "colocated": 2}
    return ", ".join(f"{n} {r}" for r, n in sorted(counts.items(), key=lambda rn: order.get(rn[0], 3))) or "none"

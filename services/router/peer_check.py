"""Whether the workers accept this router's cluster credentials; its readiness says so.

A router whose cluster secret differs from the workers' (a mistyped Secret, a rotation half done) reaches every
worker and is refused by each: every request it takes fails UNAVAILABLE. So its health stays NOT_SERVING (gRPC
and HTTP /health) while the workers it asks refuse it: a rolling update never sends it traffic and stalls on it,
and its log says why. It asks a few workers `CheckPeer` (an authenticated call that does nothing) at start, before
it reports SERVING, and every `every_s` after, as a secret may be fixed or rotated under it. Only refusals count:
a worker that does not answer says nothing of the credentials (the router stays as it was), and no worker at all
leaves it serving, as it serves without this check. Without a cluster secret every peer is accepted: no check.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

import grpc

from pdserve.background import cancel_and_wait
from pdserve.registry.base import Registry
from pdserve.rpc.server import internal_channel
from pdserve.security.cluster_secret import ClusterSecret
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)

ASKED = 3  # workers asked per check: one accepting is enough, and one wrongly configured worker is not the router
TIMEOUT_S = 2.0
EVERY_S = 10.0


class PeerCheck:
    def __init__(self, registry: Registry, cluster: ClusterSecret | None = None, every_s: float = EVERY_S) -> None:
        self.registry = registry
        self.on_change: Callable[[], Awaitable[None]] | None = None  # the health it feeds, set again on a change
        self.cluster = ClusterSecret.from_env() if cluster is None else cluster
        self.every_s = every_s
        self.refused = False
        self._task: asyncio.Task[None] | None = None

    async def check(self) -> None:
        """Asks up to ASKED workers; `refused` when at least one refused and none accepted."""
        if not self.cluster.enabled:
            return
        workers = [w for w in self.registry.workers() if not w.draining]
        asked = random.sample(workers, min(ASKED, len(workers)))
        answers = await asyncio.gather(*(_ask(w.address) for w in asked))
        refused_by = [w.worker_id for w, a in zip(asked, answers, strict=True) if a is False]
        if True in answers:
            refused = False
        elif refused_by:
            refused = True
        else:  # nobody asked, or nobody answered: nothing learnt
            return
        if refused == self.refused:
            return
        self.refused = refused
        if refused:
            log.error(
                "NOT_SERVING: workers %s refused this router's cluster credentials (UNAUTHENTICATED): its "
                "PDSERVE_CLUSTER_SECRET is not theirs; it reports SERVING again once a worker accepts them",
                ", ".join(refused_by),
            )
        else:
            log.info("the workers accept this router's cluster credentials again: SERVING")
        if self.on_change is not None:
            await self.on_change()

    def start(self) -> None:
        if self.cluster.enabled:
            self._task = asyncio.create_task(self._run(), name="peer-check")

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.check()
            except Exception:  # a registry that does not answer: the next round asks again
                log.exception("peer check failed")


async def _ask(address: str) -> bool | None:
    """True: accepted; False: refused (UNAUTHENTICATED); None: no answer that says either."""
    try:
        async with internal_channel(address) as ch:
            await worker_pb2_grpc.WorkerControlStub(ch).CheckPeer(wpb.CheckPeerRequest(), timeout=TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        return False if e.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return True

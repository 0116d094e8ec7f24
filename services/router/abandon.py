"""Telling a prefill worker that the router gave up on a request before its first token.

A decode worker that is stopped or hung (SIGSTOPped: its kernel keeps its connections open) cannot cancel the
Prefill call it made, so its prefill worker held the prompt's KV for it until that call ended by gRPC keepalive
(measured: 12.5 s after the stop) or by the KV send's own deadline, while the request ran elsewhere. Whenever an
attempt ends before its first token (a worker of it left the registry, the first-token bound passed, the caller
cancelled or its deadline passed, the decode worker failed it), the router tells the prefill worker itself
(`PrefillWorker.Abandon`), which ends that hand-off as the decode worker's cancel would; one that had already
ended answers so, and nothing else happens. Fire and forget, off the request's path, over one pooled channel per
prefill worker (a burst of cancels is a burst of small calls, not of connections): a prefill worker that does not
answer (stuck itself) or predates the call (UNIMPLEMENTED, the earlier build of a rollout) costs the call and
nothing more. The prefill worker logs the hand-off it ended (INFO); the router's line of it is DEBUG, so a burst of
cancels logs one line each, not two.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from pdserve.registry.base import WorkerState
from pdserve.rpc.channel_pool import ChannelPool
from pdserve.rpc.credentials import internal_tls_files
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)

TIMEOUT_S = 2.0


class Abandons:
    """The Abandon calls in flight; each ends within TIMEOUT_S."""

    def __init__(self, interceptors: Sequence[Any] = ()) -> None:
        """`interceptors`: the router's tracing ones; a call is sent from its request's context, so the prefill
        worker's span of it joins that request's trace rather than starting one of its own."""
        self._calls: set[asyncio.Task[None]] = set()  # strong references until done (the loop keeps weak ones)
        self._channels = ChannelPool(
            worker_pb2_grpc.PrefillWorkerStub, interceptors, credential_files=internal_tls_files()
        )

    def send(self, prefill: WorkerState, key: str) -> None:
        """Tells `prefill` that the attempt `key` (the request id it was sent) was given up on."""
        task = asyncio.get_running_loop().create_task(self._abandon(prefill, key), name="abandon")
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def close(self) -> None:
        """Closes the channels, cancelling the calls still in flight (a router stopping owes none of them)."""
        await self._channels.close()

    async def _abandon(self, prefill: WorkerState, key: str) -> None:
        request = wpb.AbandonRequest(request_id=key)
        try:
            reply = await self._channels.call(prefill.address, lambda stub: stub.Abandon(request, timeout=TIMEOUT_S))
        except grpc.aio.AioRpcError as e:
            log.debug("prefill worker %s did not take the abandon: %s", prefill.worker_id, e.code(), extra={"key": key})
            return
        if reply.ended:
            log.debug("prefill worker %s ended the hand-off given up on", prefill.worker_id, extra={"key": key})

"""The decode worker's client of prefill workers: one Prefill call, its two events as plain values."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from pdserve.errors import UnavailableError
from pdserve.protocol.handoff import FirstToken, KVTarget
from pdserve.rpc.channel_pool import ChannelPool
from pdserve.rpc.convert import finish_reason_from_pb, logprobs_from_pb, sampling_to_pb
from pdserve.rpc.credentials import internal_tls_files
from pdserve.rpc.errors import error_from_rpc
from pdserve.rpc.stream_end import cancel_stream
from pdserve.telemetry import Telemetry
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc

if TYPE_CHECKING:
    from services.decode.handoff import HandoffRequest


class PrefillCall:
    """One Prefill call in flight. Errors arrive as the typed errors of `rpc/errors.py`, naming the worker."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, address: str) -> None:
        self._call = call
        self._peer = f"prefill worker {address}"

    async def first_token(self) -> FirstToken:
        event = await self._read()
        if event is grpc.aio.EOF or not event.HasField("first_token"):
            raise UnavailableError(f"{self._peer} ended without a first token")
        first = event.first_token
        logprobs = logprobs_from_pb(first.logprobs) if first.HasField("logprobs") else None
        prompt_logprobs = tuple(logprobs_from_pb(lp) for lp in first.prompt_logprobs)
        cached, waited_s = first.cached_prompt_tokens, first.waited_ms / 1e3 if first.HasField("waited_ms") else None
        ended = finish_reason_from_pb(first.finish_reason)
        return FirstToken(first.token_id, first.kv_follows, cached, logprobs, prompt_logprobs, waited_s, ended)

    async def sent(self) -> None:
        """Returns once the prefill worker confirmed the KV sent and ended the call with OK."""
        while await self._read() is not grpc.aio.EOF:
            pass

    async def cancel(self) -> None:
        """Stops the prefill worker's work on it, and ends the call's span; a no-op once the call ended."""
        await cancel_stream(self._call)

    async def _read(self) -> wpb.PrefillEvent:
        try:
            return await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self._peer) from e


class PrefillClient:
    """Calls prefill workers over one channel each, closed once idle (`ChannelPool`)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self._channels = ChannelPool(
            worker_pb2_grpc.PrefillWorkerStub, telemetry.client_interceptors(), credential_files=internal_tls_files()
        )

    def prefill(
        self,
        address: str,
        handoff: HandoffRequest,
        target: KVTarget,
        transfer_timeout_s: float,
        timeout_s: float | None,
    ) -> PrefillCall:
        request = wpb.PrefillRequest(
            request_id=handoff.request.request_id,
            client_request_id=handoff.client_request_id,
            cache_salt=handoff.request.cache_salt,
            prompt_token_ids=handoff.request.prompt,
            sampling=sampling_to_pb(handoff.request.sampling),
            resumed_output_tokens=handoff.request.resumed_output_tokens,
            tenant=handoff.request.tenant,
            priority=handoff.request.priority,
            target=wpb.KVTarget(
                decode_worker_id=target.decode_worker_id,
                rendezvous=target.rendezvous,
                block_ids=target.block_ids,
                tag=target.tag,
            ),
            layout=wpb.KVLayout(model_fingerprint=target.model_fingerprint, block_size=target.block_size),
            transfer_timeout_ms=max(1, int(transfer_timeout_s * 1e3)),
        )
        return PrefillCall(self._channels.call(address, lambda stub: stub.Prefill(request, timeout=timeout_s)), address)

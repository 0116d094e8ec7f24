"""Streams held open under an API key on a cluster that serves TLS, over gRPC and the HTTP API's Server-Sent Events,
and how each ended."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass

import grpc
import httpx2

from pdserve.rpc.credentials import ClientCredentials
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc


@dataclass
class Ended:
    """`status`: the gRPC status's name, or an SSE stream's `error.code` ("OK" for neither); `first_at`, `ended_at`:
    time.monotonic() at its first token and at its end."""

    status: str = "OK"
    details: str = ""
    tokens: int = 0
    first_at: float = 0.0
    ended_at: float = 0.0


async def grpc_stream(address: str, creds: ClientCredentials, max_tokens: int, first: asyncio.Event) -> Ended:
    """A Generate call of `max_tokens` (EOS ignored); `first` is set at its first token."""
    ended = Ended()
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    async with channel(address, credentials=creds) as ch:
        call = generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=120, metadata=creds.metadata())
        try:
            async for msg in call:
                _counted(ended, len(msg.token_ids), first)
        except grpc.aio.AioRpcError as e:
            ended.status, ended.details = e.code().name, e.details() or ""
    ended.ended_at = time.monotonic()
    return ended


async def sse_stream(address: str, ca: str, key: str, max_tokens: int, first: asyncio.Event) -> Ended:
    """A streamed completion over HTTPS (trusting `ca`); an `error` event mid-stream is how it ended."""
    ended = Ended()
    body = {"model": "tiny-random", "prompt": "hi", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    tls = ssl.create_default_context(cafile=ca)
    async with (
        httpx2.AsyncClient(base_url=f"https://{address}", verify=tls, timeout=120) as http,
        http.stream("POST", "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}) as response,
    ):
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            event = line.removeprefix("data: ")
            if not line.startswith("data: ") or event == "[DONE]":
                continue
            data = json.loads(event)
            if "error" in data:
                ended.status, ended.details = str(data["error"]["code"]), data["error"]["message"]
            else:
                _counted(ended, 1, first)  # counts events: a token's text, or a few tokens' together
    ended.ended_at = time.monotonic()
    return ended


def _counted(ended: Ended, tokens: int, first: asyncio.Event) -> None:
    if tokens and not ended.tokens:
        ended.first_at = time.monotonic()
        first.set()
    ended.tokens += tokens

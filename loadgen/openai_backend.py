"""The `openai` and `openai-chat` backends: any OpenAI-compatible server (pdserve's HTTP API, vLLM, SGLang, ...)
over HTTP, streamed as Server-Sent Events, sent as `vllm bench serve` sends them: temperature 0, ignore_eos,
stream_options.include_usage.

Timing follows vLLM's: each SSE chunk with a choice is one streamed message of one token, whatever its text (a chat
delta's content is empty while a multi-byte character is incomplete, and on the chunk with the finish_reason),
except a chat opener that names the role and carries no content field at all: one ITL-per-chunk gap per chunk. A
chunk does not say how many tokens it carries, so a stream whose usage counts more tokens than chunks has no
per-token ITL (metrics.token_itls_s). The final usage chunk's completion_tokens is the output's count
(`RequestRecord.reported_tokens`), which TPOT divides by, whether a server packs several tokens into a chunk or
sends chunks with none; its prompt_tokens is the request's input length. Chat prompts are the workload's token ids
decoded to text, so the server's chat template and tokenizer make the prompt's exact length (measured: a workload's
2001 prompt tokens were 4290 to the server). A request's body (its detokenizing, its JSON) is built before its
timer starts, as gRPC's message is. Each stream is read to its end, past `[DONE]`, so its connection goes back to
the pool: a connection closed instead would put the next request's connect (and TLS handshake) into its TTFT. For
the same reason a session opens its connections before the run, as the gRPC backend waits for its channel: HTTP/1.1
carries one stream per connection, so it opens as many as may be in flight (`warm_connections`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx2

from loadgen.client import Send
from loadgen.record import RequestRecord
from loadgen.workload import Request
from pdserve.rpc.credentials import ClientCredentials

AFTER_DONE_S = 1.0  # the longest a stream's body is read past `[DONE]` (its end is due at once)
JSON_HEADERS = {"content-type": "application/json"}
WARM_PATH = "/v1/models"  # a cheap GET every OpenAI-compatible server answers (any answer opens the connection)
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
# HTTP statuses as the gRPC code names the records and summaries count (429: shed, as RESOURCE_EXHAUSTED).
STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
# The `type` of an error event sent after a stream began (pdserve's, OpenAI's names) -> the status it stands for.
ERROR_TYPE_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "rate_limit_error": 429,
    "service_unavailable_error": 503,
    "timeout_error": 504,
}


@dataclass(frozen=True)
class OpenAIBackend:
    base_url: str  # the server's root, e.g. http://127.0.0.1:8000
    model: str  # sent as `model`
    chat: bool = False
    endpoint: str | None = None  # default: ENDPOINTS for the backend
    slo: dict[str, float] | None = None  # pdserve's `slo` extension, sent when set
    detokenize: Callable[[list[int]], str] | None = None  # chat: the prompt ids as text
    credentials: ClientCredentials | None = None  # the API key (`Authorization: Bearer KEY`), TLS CA, client cert
    priority: int = 0  # pdserve's `priority` extension, sent when not 0

    @asynccontextmanager
    async def session(self, max_concurrency: int) -> AsyncGenerator[Send, None]:
        limits = httpx2.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        creds = self.credentials or ClientCredentials()
        headers = {"authorization": f"Bearer {creds.api_key}"} if creds.api_key else None
        verify: ssl.SSLContext | bool = True
        if creds.tls_ca:
            verify = ssl.create_default_context(cafile=creds.tls_ca)
            if creds.tls_cert:
                verify.load_cert_chain(creds.tls_cert, creds.tls_key)
        async with httpx2.AsyncClient(
            base_url=self.base_url, timeout=None, limits=limits, headers=headers, verify=verify
        ) as http:
            await self.warm_connections(http, max_concurrency)
            yield partial(self._stream, http)

    async def warm_connections(self, http: httpx2.AsyncClient, count: int) -> None:
        """`count` connections opened and back in the pool: GETs sent together, none finding an idle connection,
        each opens one. A failure is left to the requests themselves to report (the check request first)."""
        warm = [http.get(WARM_PATH, extensions=self._extensions()) for _ in range(count)]
        await asyncio.gather(*warm, return_exceptions=True)

    def payload(self, req: Request) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "temperature": 0.0, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        if self.chat:
            assert self.detokenize is not None
            body["messages"] = [{"role": "user", "content": self.detokenize(req.prompt_token_ids)}]
            body["max_completion_tokens"] = req.output_len
        else:
            body["prompt"] = req.prompt_token_ids
            body["max_tokens"] = req.output_len
        if self.slo:
            body["slo"] = self.slo
        if self.priority:
            body["priority"] = self.priority
        return body

    async def _stream(self, http: httpx2.AsyncClient, req: Request, record: RequestRecord) -> None:
        url = self.endpoint or ENDPOINTS["openai-chat" if self.chat else "openai"]
        body = json.dumps(self.payload(req), ensure_ascii=False, separators=(",", ":")).encode()  # before the timer
        sent = record.sent_clock = time.perf_counter()
        usage_tokens = None
        try:
            stream = http.stream("POST", url, content=body, headers=JSON_HEADERS, extensions=self._extensions())
            async with stream as response:
                if response.status_code != 200:
                    _failed(record, response.status_code, (await response.aread()).decode(errors="replace"))
                    return
                async for chunk in _events(response):
                    if "error" in chunk:  # failed after the stream began: its type says how, as a status would
                        error = chunk["error"]
                        status = ERROR_TYPE_STATUS.get(str(error.get("type")), 500) if isinstance(error, dict) else 500
                        _failed(record, status, json.dumps(chunk))
                        return
                    if self._carries_output(chunk):
                        record.message_times_s.append(time.perf_counter() - sent)
                        record.message_tokens.append(1)
                    usage = chunk.get("usage") or {}
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    record.input_len = usage.get("prompt_tokens", record.input_len)
        except httpx2.HTTPError as e:
            record.status, record.error = "UNAVAILABLE", f"{type(e).__name__}: {e}"
            return
        if record.message_tokens:  # the server's count wins over one token per chunk: TPOT's, not the ITLs'
            record.reported_tokens = usage_tokens

    def _extensions(self) -> dict[str, str] | None:
        """The name the server's certificate must carry, when it is not the host dialled."""
        server_name = self.credentials.server_name if self.credentials and self.credentials.tls_ca else None
        return {"sni_hostname": server_name} if server_name else None

    def _carries_output(self, chunk: dict[str, Any]) -> bool:
        choices = chunk.get("choices")
        if not choices:
            return False
        delta = choices[0].get("delta", {}) if self.chat else {}
        return not ("role" in delta and "content" not in delta and not choices[0].get("finish_reason"))


async def _events(response: httpx2.Response) -> AsyncGenerator[dict[str, Any], None]:
    lines = response.aiter_lines()
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":  # read on to the body's end, so the connection goes back to the pool; a server
            with contextlib.suppress(TimeoutError):  # that keeps it open past that loses it instead
                async with asyncio.timeout(AFTER_DONE_S):
                    async for _ in lines:
                        pass
            return
        yield json.loads(data)


def _failed(record: RequestRecord, status: int, body: str) -> None:
    record.status = STATUS_NAMES.get(status, f"HTTP_{status}")
    try:
        record.error = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        record.error = body[:500]

"""Sending a workload through one backend's session, each request at its arrival offset, in flight at most
`max_concurrency` at a time. One rule whichever bound holds a request (--max-concurrency, or loadgen's own default):
its latencies are timed from its send, as vLLM times them under --max-concurrency, and the hold is recorded
(RequestRecord.wait_s) and summarized apart, never folded into TTFT. What a request looks like on the wire is the
backend's (grpc_backend.py, openai_backend.py); the timing of every streamed message goes into the same
RequestRecord either way."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import Protocol

from loadgen.record import CANCELLED, CLIENT_ERROR, EMPTY_STREAM, OK, RequestRecord
from loadgen.workload import Request

# grpc.aio starts cancelling calls when too many are in flight on one channel (measured: 2,000 unbounded
# calls gave 140 CANCELLED), so in-flight calls are always bounded: by this when --max-concurrency is not given.
# The result records the bound in force either way (never null, which in vLLM's files means unbounded).
DEFAULT_MAX_CONCURRENCY = 256
BACKENDS = ("grpc", "openai", "openai-chat")  # as `vllm bench serve --backend` names the OpenAI ones

# Sends one request and fills its record: status, and the time and token count of each streamed message.
Send = Callable[[Request, RequestRecord], Awaitable[None]]


class Backend(Protocol):
    def session(self, max_concurrency: int) -> AbstractAsyncContextManager[Send]:
        """Connected (connecting is not the server's latency) until the context ends, for up to `max_concurrency`
        requests in flight: the most the run can have (the bound, or its request count when fewer)."""
        ...


class RunInterrupted(Exception):
    """The run was cancelled (Ctrl-C) midway: it sent no more, cancelled the requests in flight, and carries the
    records of those it sent (the cancelled ones CANCELLED) and the time from the run's clock start to the cancel."""

    def __init__(self, records: list[RequestRecord], duration_s: float) -> None:
        super().__init__(f"interrupted after {len(records)} requests sent")
        self.records, self.duration_s = records, duration_s


class Client:
    def __init__(self, backend: Backend, max_concurrency: int | None = None) -> None:
        self.backend = backend
        self.max_concurrency = max_concurrency or DEFAULT_MAX_CONCURRENCY

    async def run(
        self,
        requests: list[Request],
        on_done: Callable[[RequestRecord], None] = lambda r: None,
        warmup: Sequence[Request] = (),
        on_warmup: Callable[[list[RequestRecord]], None] = lambda records: None,
    ) -> tuple[list[RequestRecord], float]:
        """Sends each request at its arrival offset; returns the records (in workload order) and the duration
        from the run's clock start (its arrival offsets' 0, a drawn gap before the first send, as vLLM starts its
        clock) to the last answer. The `warmup` requests go first, all at once in the same session
        (its connections, the server's caches and compiled paths warmed), and are awaited before the run's clock
        starts; their records go to `on_warmup`, into no figure of the run."""
        tag = uuid.uuid4().hex[:8]
        async with self.backend.session(min(self.max_concurrency, max(len(requests), len(warmup)))) as send:
            slots = asyncio.Semaphore(self.max_concurrency)
            if warmup:
                try:
                    warmed, _ = await self._send_all(send, slots, [replace(r, arrival_s=0.0) for r in warmup], "warmup")
                except RunInterrupted:  # nothing of the run was sent
                    raise RunInterrupted([], 0.0) from None
                on_warmup(warmed)
            return await self._send_all(send, slots, requests, tag, on_done)

    async def _send_all(
        self,
        send: Send,
        slots: asyncio.Semaphore,
        requests: Sequence[Request],
        tag: str,
        on_done: Callable[[RequestRecord], None] = lambda r: None,
    ) -> tuple[list[RequestRecord], float]:
        start = time.perf_counter()
        sent: dict[int, RequestRecord] = {}  # by workload index: those that got a slot and went out

        async def one(i: int, req: Request) -> None:
            record = RequestRecord(f"loadgen-{tag}-{i}", req.input_len, req.output_len, req.arrival_s)
            queued = time.perf_counter()
            async with slots:
                record.sent_clock = time.perf_counter()  # until the backend sends, its message built
                record.wait_s = record.sent_clock - queued  # the bound's hold alone, not loadgen's lateness
                sent[i] = record
                try:
                    await send(req, record)
                except asyncio.CancelledError:
                    record.status, record.error = CANCELLED, "loadgen was interrupted before the answer ended"
                    record.error_s = time.perf_counter() - record.sent_clock
                    raise
                except Exception as e:  # the client's own (a malformed event, a transport error): this one fails
                    record.status, record.error = CLIENT_ERROR, f"{type(e).__name__}: {e}"
                finally:  # the send its latencies count from, its message built: what the server was offered
                    record.start_s = record.sent_clock - start
            if record.status == OK and not record.output_tokens:
                record.status, record.error = EMPTY_STREAM, "the stream ended without a token"
            if record.status != OK:
                record.error_s = time.perf_counter() - record.sent_clock
            on_done(record)

        tasks = []
        try:
            for i, req in enumerate(requests):
                delay = start + req.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, req)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels this task; send no more, cancel the rest
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise RunInterrupted([sent[i] for i in sorted(sent)], time.perf_counter() - start) from None
        return [sent[i] for i in range(len(requests))], time.perf_counter() - start

    async def check(self, request: Request) -> RequestRecord:
        """One request on its own, before a run: a cluster that cannot answer fails fast, not N times."""
        records, _ = await self.run([request])
        return records[0]

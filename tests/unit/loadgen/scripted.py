"""A scripted server for the client's tests: each request's messages come at times the test sets, not at times
the machine keeps, so what is asserted never depends on how fast a noisy machine runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from loadgen.client import Send
from loadgen.record import RequestRecord
from loadgen.workload import Request


class ScriptedBackend:
    """Answers each request with `messages` (seconds from its send, tokens), after yielding to the loop once so
    that the requests due together are all in flight, or held by the bound, before any answer."""

    def __init__(self, messages: list[tuple[float, int]]) -> None:
        self.messages = messages

    @asynccontextmanager
    async def session(self, max_concurrency: int) -> AsyncIterator[Send]:
        async def send(req: Request, record: RequestRecord) -> None:
            await asyncio.sleep(0)
            for t, n in self.messages:
                record.message_times_s.append(t)
                record.message_tokens.append(n)

        yield send

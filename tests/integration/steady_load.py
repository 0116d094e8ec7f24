"""Steady greedy load through a router while a test changes the cluster under it (drains, restarts, scaling),
and the check that every request of it was served with the reference output."""

from __future__ import annotations

import asyncio

from pdserve.rpc.client import generate
from pdserve.v1 import generate_pb2 as pb
from tests.integration.reference import greedy_request


async def tokens(router: str, req: pb.GenerateRequest) -> list[int]:
    """The request's tokens; it must run to max_tokens."""
    result = None
    async for _, result in generate(router, req, 120.0):  # noqa: B007 (the last one is the answer)
        pass
    assert result is not None and result.finish_reason == "length", result
    return result.token_ids


async def steady_load(
    router: str, stop: asyncio.Event, rate_per_s: float, prefix: str, prompt: list[int], max_tokens: int
) -> list[list[int] | BaseException]:
    """Greedy requests at a steady rate until `stop`; every one's outcome."""
    calls = []
    while not stop.is_set():
        req = greedy_request(f"{prefix}{len(calls)}", prompt, max_tokens)
        calls.append(asyncio.create_task(tokens(router, req)))
        await asyncio.sleep(1 / rate_per_s)
    return await asyncio.gather(*calls, return_exceptions=True)


def assert_all_served(outcomes: list, expected: list[int]) -> None:
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert not failed, f"{len(failed)} of {len(outcomes)} failed: {failed[:3]}"
    assert all(o == expected for o in outcomes)

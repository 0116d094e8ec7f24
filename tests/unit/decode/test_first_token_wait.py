"""The prefill worker's wait, as the decode worker reads it from the first event: a prefill worker of an earlier
build sets no `waited_ms`, and that must read as not reported, not as a prompt that waited 0 ms (the router would
take its prediction's queue off and none of its measured TTFT, learning other routers' prompts as slowness)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.v1 import worker_pb2 as wpb
from services.decode.prefill_client import PrefillCall


class _Events:
    """A prefill call's stream, as grpc.aio's call reads it."""

    def __init__(self, *events: wpb.PrefillEvent) -> None:
        self._events = list(events)

    async def read(self) -> wpb.PrefillEvent:
        return self._events.pop(0)


@pytest.mark.parametrize(
    ("first", "waited_s"),
    [
        (wpb.FirstToken(token_id=5), None),
        (wpb.FirstToken(token_id=5, waited_ms=0), 0.0),
        (wpb.FirstToken(token_id=5, waited_ms=1500), 1.5),
    ],
)
def test_a_wait_is_what_the_prefill_worker_reported_and_none_when_it_reported_none(first, waited_s):
    call = PrefillCall(_Events(wpb.PrefillEvent(first_token=first)), "127.0.0.1:1")  # type: ignore[arg-type]
    assert asyncio.run(call.first_token()).waited_s == waited_s

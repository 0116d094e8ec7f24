"""A prefill worker says how long each prompt waited for it, through its decode worker's trailing metadata: what
lets a router take other routers' prompts ahead of its own out of the TTFT its calibration learns from. In-process
workers called as a router calls them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from pdserve.rpc.metadata import PREFILL_WAITED_KEY
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.in_process_workers import in_process_workers

pytestmark = pytest.mark.timeout(180)


def test_a_prompt_behind_another_is_reported_waiting_about_as_long_as_that_one_ran():
    with in_process_workers("wait") as (prefill, decode):
        queued = lambda: prefill.state().queued_prefill_tokens > 0  # noqa: E731
        alone, behind, ahead_s = asyncio.run(waits(decode.address(60), prefill.address(60), queued))
    print(f"waited alone {alone} ms; behind a prompt whose first token took {ahead_s * 1e3:.0f} ms: {behind} ms")
    assert alone < 50
    assert 0.3 * ahead_s * 1e3 < behind <= ahead_s * 1e3 + 50


async def waits(decode_address: str, prefill_address: str, queued: Callable[[], bool]) -> tuple[int, int, float]:
    """The waits reported for a prompt alone, and for one sent right behind a long one (itself longer than a step,
    so it does not go ahead of the long one's chunks: engine/short_first.py); how long the long one's first token
    took."""

    def handed_off(prompt_len: int, shift: int) -> worker_pb2.WorkerGenerateRequest:
        return worker_pb2.WorkerGenerateRequest(
            request_id=f"r{time.monotonic_ns()}",
            prompt_token_ids=[3 + (i + shift) % 200 for i in range(prompt_len)],
            sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True),
            prefill_address=prefill_address,
        )

    async def waited_ms(stub: worker_pb2_grpc.DecodeWorkerStub, prompt_len: int, shift: int = 0) -> tuple[int, float]:
        start = time.monotonic()
        call, first_at = stub.Generate(handed_off(prompt_len, shift), timeout=60), 0.0
        async for _ in call:
            first_at = first_at or time.monotonic() - start
        assert await call.code() == grpc.StatusCode.OK
        return int(dict(await call.trailing_metadata())[PREFILL_WAITED_KEY]), first_at

    async with channel(decode_address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        alone, _ = await waited_ms(stub, 16)
        long = asyncio.ensure_future(waited_ms(stub, 3500))
        while not queued() and not long.done():  # the long prompt reaches the prefill worker first
            await asyncio.sleep(0.001)
        # Past one step's 512 tokens and sharing no block with the long one: no short prompt, so it waits its turn.
        behind, _ = await waited_ms(stub, 600, shift=1)
        _, ahead_s = await long
    return alone, behind, ahead_s

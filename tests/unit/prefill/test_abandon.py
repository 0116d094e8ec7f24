"""The router's Abandon reaches a Prefill call from its start: one that comes while the request is still being
converted (a grammar compiled on the engine's thread) ends the call before its prompt runs, as one that comes
later ends the step in flight, and one that overtakes its call ends it on arrival. The engine is real
(tiny-random, prefill only); no KV is sent."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pdserve.errors import AbandonedError
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.prefill.run_and_send import RunAndSend
from services.prefill.servicer import PrefillServicer
from tests.unit.prefill.test_send_cancel import SlowSender, prefill_engine

pytestmark = pytest.mark.timeout(60)


async def test_an_abandon_while_the_request_is_converted_ends_the_call_before_its_prompt_runs() -> None:
    engine = prefill_engine()
    servicer = PrefillServicer(RunAndSend(engine, SlowSender(engine), "p0", Telemetry("t")))  # type: ignore[arg-type]
    request = wpb.PrefillRequest(
        request_id="r",
        prompt_token_ids=list(range(3, 23)),
        sampling=pb.SamplingParams(max_tokens=8, regex="[a-z]{1,8}"),  # a grammar: compiled off the loop
        target=wpb.KVTarget(decode_worker_id="d0", rendezvous="127.0.0.1:1", block_ids=list(range(5)), tag=1),
        layout=wpb.KVLayout(model_fingerprint=engine.fingerprint, block_size=engine.block_size),
        transfer_timeout_ms=5000,
    )
    try:
        call = servicer.Prefill(request, None)  # type: ignore[arg-type]
        first = asyncio.ensure_future(call.__anext__())
        await asyncio.sleep(0)  # the call is in its conversion, awaiting its grammar's compiling thread
        assert not first.done()
        reply = await servicer.Abandon(wpb.AbandonRequest(request_id="r"), None)  # type: ignore[arg-type]
        assert reply.ended
        with pytest.raises(AbandonedError, match="ended this attempt before its first token"):
            await first
        assert engine.stats["kv_blocks_used"] == 0
        assert not (await servicer.Abandon(wpb.AbandonRequest(request_id="r"), None)).ended  # type: ignore[arg-type]
    finally:
        with contextlib.suppress(Exception):
            await call.aclose()
        engine.stop()


async def test_an_abandon_that_overtakes_its_call_ends_the_call_when_it_comes_before_it_takes_kv() -> None:
    engine = prefill_engine()
    servicer = PrefillServicer(RunAndSend(engine, SlowSender(engine), "p0", Telemetry("t")))  # type: ignore[arg-type]

    def request(request_id: str) -> wpb.PrefillRequest:
        return wpb.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=list(range(3, 23)),
            sampling=pb.SamplingParams(max_tokens=8),
            target=wpb.KVTarget(decode_worker_id="d0", rendezvous="127.0.0.1:1", block_ids=list(range(5)), tag=1),
            layout=wpb.KVLayout(model_fingerprint=engine.fingerprint, block_size=engine.block_size),
            transfer_timeout_ms=5000,
        )

    try:
        reply = await servicer.Abandon(wpb.AbandonRequest(request_id="late"), None)  # type: ignore[arg-type]
        assert not reply.ended  # nothing held yet
        late = servicer.Prefill(request("late"), None)  # type: ignore[arg-type]
        with pytest.raises(AbandonedError, match="ended this attempt before its first token"):
            await late.__anext__()
        assert engine.stats["kv_blocks_used"] == 0 and engine.stats["kv_blocks_cached"] == 0  # its prompt never ran
        other = servicer.Prefill(request("other"), None)  # type: ignore[arg-type]
        try:
            assert (await other.__anext__()).HasField("first_token")  # only the abandoned key is refused
        finally:
            await other.aclose()
    finally:
        engine.stop()

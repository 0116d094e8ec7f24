"""A prompt a prefill worker refuses as the caller's mistake (INVALID_ARGUMENT: longer than its whole KV) is no
failure of the worker's: its spans say `refused`, not ERROR with an exception, as the router's spans do for what
they answer the caller. Error rates read from span status then do not rise with client bugs."""

from __future__ import annotations

import contextlib

import pytest
from opentelemetry.trace import StatusCode

from pdserve.errors import InvalidRequestError
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.handoff import KVTarget
from pdserve.protocol.sampling import SamplingParams
from services.prefill.run_and_send import PrefillJob
from tests.unit.prefill.traced_worker import traced_worker

pytestmark = pytest.mark.timeout(60)


async def test_a_prompt_past_the_workers_kv_is_refused_on_its_spans_not_an_error() -> None:
    worker, engine, exporter = traced_worker()
    request = EngineRequest("too-long", list(range(3, 103)), SamplingParams(max_tokens=8))  # 25 blocks of 4
    target = KVTarget("d0", "127.0.0.1:1", list(range(25)), 1, engine.fingerprint, engine.block_size)
    try:
        with pytest.raises(InvalidRequestError, match="25 KV blocks"):
            async with contextlib.aclosing(worker.run(PrefillJob(request, target, 5.0))) as events:
                async for _ in events:
                    pass
    finally:
        engine.stop()
    spans = exporter.get_finished_spans()
    assert spans and all(s.status.status_code != StatusCode.ERROR and not s.events for s in spans)
    assert any("25 KV blocks" in s.attributes.get("refused", "") for s in spans)

"""A request's input length is the prompt the server processed, where its answer says: a chat prompt is the ids'
text, which the server tokenizes anew inside its chat template (measured: 2001 workload tokens, 4290 served)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx2
import pytest

from loadgen import metrics
from loadgen.grpc_backend import _stream
from loadgen.metrics import GoodputSLO
from loadgen.openai_backend import OpenAIBackend
from loadgen.record import RequestRecord
from loadgen.workload import Request
from pdserve.v1 import generate_pb2 as pb

PROMPT = Request([5, 6, 7], 2)  # the workload's 3 prompt tokens


async def openai_record(chat: bool, usage: dict[str, int]) -> RequestRecord:
    token = {"choices": [{"index": 0, "delta": {"content": "a"}, "text": "a"}]}
    events = [token, token, {"choices": [], "usage": usage}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    transport = httpx2.MockTransport(lambda request: httpx2.Response(200, text=body))
    backend = OpenAIBackend("http://h", "m", chat=chat, detokenize=lambda ids: "five six seven")
    record = RequestRecord("r", PROMPT.input_len, PROMPT.output_len, 0.0)
    async with httpx2.AsyncClient(base_url="http://h", transport=transport) as http:
        await backend._stream(http, PROMPT, record)
    return record


@pytest.mark.parametrize("chat", [False, True])
async def test_the_usage_prompt_tokens_are_the_input_length_and_the_runs_input_total(chat):
    served = await openai_record(chat, {"prompt_tokens": 11, "completion_tokens": 2})
    assert served.input_len == 11
    summary = metrics.summarize([served, await openai_record(chat, {"prompt_tokens": 9})], 1.0, GoodputSLO())
    assert summary["total_input_tokens"] == 20
    assert (await openai_record(chat, {"completion_tokens": 2})).input_len == 3  # no count: the workload's


class Stub:
    """The router's Generate: a token, then the last message with its usage."""

    def __init__(self, prompt_tokens: int) -> None:
        self.usage = pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=2)

    async def Generate(self, msg: pb.GenerateRequest, metadata: tuple) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        yield pb.GenerateResponse(token_ids=[9])
        yield pb.GenerateResponse(token_ids=[9], usage=self.usage)


@pytest.mark.parametrize(("reported", "input_len"), [(4, 4), (0, 3)])
async def test_grpc_takes_the_usage_prompt_tokens_when_the_server_reports_them(reported, input_len):
    record = RequestRecord("r", PROMPT.input_len, PROMPT.output_len, 0.0)
    await _stream(Stub(reported), None, 0, (), PROMPT, record)  # type: ignore[arg-type]
    assert (record.input_len, record.output_tokens) == (input_len, 2)

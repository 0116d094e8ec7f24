"""The HTTP API's response objects carry the fields OpenAI's carry, null where pdserve has nothing to say: a chat
message's `refusal` and every object's `system_fingerprint` (clients that read them found no key)."""

from __future__ import annotations

from pdserve.engine.model_files import locate_model, read_model_config, tokenizer_folder
from pdserve.engine.tokenizer import Tokenizer
from pdserve.protocol.request_checks import RequestLimits
from pdserve.v1 import generate_pb2 as pb
from services.router.http.openai_request import parse_request
from services.router.http.openai_response import Answer

TINY = locate_model("tiny-random")
CHAT = {"model": "tiny-random", "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": "tiny-random", "prompt": "x"}
LAST = pb.GenerateResponse(text="hi", token_ids=[5], finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage())


def answer(body: dict, chat: bool) -> Answer:
    request = parse_request(body, chat, limits=RequestLimits(), model_config=read_model_config(TINY))
    return Answer(request, "chatcmpl-0" if chat else "cmpl-0", Tokenizer(tokenizer_folder(TINY)))


def test_a_chat_completion_has_a_null_refusal_and_system_fingerprint():
    chat = answer(CHAT, chat=True)
    chat.add(0, LAST)
    whole = chat.whole()
    assert list(whole) == ["id", "object", "created", "model", "system_fingerprint", "choices", "usage"]
    assert whole["system_fingerprint"] is None
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "hi", "refusal": None}


def test_every_chunk_and_a_completion_have_a_null_system_fingerprint():
    chat = answer(CHAT | {"stream": True}, chat=True)
    assert chat.chunk(0, LAST)["system_fingerprint"] is None
    completion = answer(COMPLETION, chat=False)
    completion.add(0, LAST)
    whole = completion.whole()
    assert whole["system_fingerprint"] is None and "refusal" not in whole["choices"][0]  # a text choice has none

"""The completions API's legacy `top_logprobs`, a dict keyed by each token's text: tokens that decode alike share
a key, which keeps the most likely one's log probability."""

from __future__ import annotations

from pdserve.engine.model_files import locate_model, read_model_config, tokenizer_folder
from pdserve.engine.tokenizer import Tokenizer
from pdserve.protocol.request_checks import RequestLimits
from pdserve.v1 import generate_pb2 as pb
from services.router.http.openai_request import parse_request
from services.router.http.openai_response import Answer

TINY = locate_model("tiny-random")
BYTES = (131, 132, 133)  # tiny-random's byte tokens past ASCII: each alone decodes to U+FFFD
OTHER = 33  # decodes to "\x1e"


def top_logprobs(sampled: int, logprob: float, alternatives: list[tuple[int, float]]) -> dict[str, float]:
    body = {"model": "tiny-random", "prompt": [5, 6], "logprobs": len(alternatives)}
    request = parse_request(body, False, limits=RequestLimits(), model_config=read_model_config(TINY))
    answer = Answer(request, "cmpl-0", Tokenizer(tokenizer_folder(TINY)))
    ids, values = zip(*alternatives, strict=True)
    lp = pb.TokenLogprobs(logprob=logprob, top_token_ids=ids, top_logprobs=values)
    answer.add(0, pb.GenerateResponse(token_ids=[sampled], logprobs=[lp]))
    return answer.whole()["choices"][0]["logprobs"]["top_logprobs"][0]


def test_alternatives_that_decode_alike_keep_the_most_likely_value():
    got = top_logprobs(OTHER, -8.0, [(BYTES[0], -6.0), (BYTES[1], -7.0)])
    assert got == {"\ufffd": -6.0, "\x1e": -8.0}


def test_a_sampled_token_outside_the_alternatives_does_not_replace_a_likelier_one_decoded_alike():
    got = top_logprobs(BYTES[2], -30.0, [(BYTES[0], -6.0), (OTHER, -7.0)])
    assert got == {"\ufffd": -6.0, "\x1e": -7.0}

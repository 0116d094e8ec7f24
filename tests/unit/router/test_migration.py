"""A migrated stream's text, re-derived by the router: identical to what one detokenizer over the whole output
writes, even where the break falls inside a held-back character or a stop string."""

from __future__ import annotations

from dataclasses import replace

from tokenizers import Tokenizer, decoders, models

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.protocol.sampling import SamplingParams
from pdserve.v1 import generate_pb2 as pb
from services.router.migration import Continuation, continued_request
from services.router.request import RoutedRequest

ALPHABET = "xyzabcdefgh"


def letters() -> Tokenizer:
    """A tokenizer with one letter per token id."""
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(ALPHABET)}, unk_token="x"))
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


LETTERS = letters()


def request(max_tokens: int = 10, stop: tuple[str, ...] = ()) -> RoutedRequest:
    return RoutedRequest("r", [0, 1, 2], SamplingParams(max_tokens=max_tokens, stop=stop), 0.0, 0.0, 0)


def whole(req: RoutedRequest, tokens: list[int]) -> tuple[str, bool]:
    detok = IncrementalDetokenizer(LETTERS, req.prompt_token_ids, stop=req.sampling.stop)
    text = "".join(detok.step([t]) for t in tokens)
    return (text if detok.stopped else text + detok.flush()), detok.stopped


def migrated(req: RoutedRequest, streamed: list[int], rest: list[int]) -> tuple[str, int]:
    """The client's text: the old worker's messages, then the continuation's as the router rewrites them."""
    old = IncrementalDetokenizer(LETTERS, req.prompt_token_ids, stop=req.sampling.stop)
    text = "".join(old.step([t]) for t in streamed)
    continuation = Continuation(LETTERS, req, [[t] for t in streamed])
    reason = pb.FINISH_REASON_UNSPECIFIED
    for i, t in enumerate(rest):
        last = i == len(rest) - 1
        msg = pb.GenerateResponse(token_ids=[t], text="?", finish_reason=pb.FINISH_REASON_LENGTH if last else 0)
        continuation.rewrite(msg)
        text, reason = text + msg.text, msg.finish_reason
        if reason != pb.FINISH_REASON_UNSPECIFIED:
            break
    return text, reason


def test_a_continued_request_prefills_what_was_streamed_and_asks_for_the_rest():
    req = continued_request(request(max_tokens=10), [5, 6, 7])
    assert req.prompt_token_ids == [0, 1, 2, 5, 6, 7] and req.sampling.max_tokens == 7
    assert req.resumed_output_tokens == 3  # penalties count them as output
    asked = replace(request(max_tokens=10), sampling=SamplingParams(max_tokens=10, prompt_logprobs=1))
    assert continued_request(asked, [5]).sampling.prompt_logprobs is None  # the client has them already
    again = continued_request(req, [8])  # moved a second time
    assert again.prompt_token_ids == [0, 1, 2, 5, 6, 7, 8] and again.resumed_output_tokens == 4


def test_the_text_after_a_break_is_the_unbroken_stream_s_text():
    req, tokens = request(stop=("gh",)), [3, 4, 5, 6, 3, 4]
    for cut in range(1, len(tokens)):
        text, reason = migrated(req, tokens[:cut], tokens[cut:])
        assert (text, reason) == (whole(req, tokens)[0], pb.FINISH_REASON_LENGTH), cut


def test_a_stop_string_spanning_the_break_ends_the_stream_with_stop():
    req = request(stop=("cd",))  # "c" is token 5, "d" token 6
    tokens = [3, 4, 5, 6, 7]
    expected_text, stopped = whole(req, tokens[:4])
    assert stopped
    text, reason = migrated(req, tokens[:3], tokens[3:])  # the break between "c" and "d"
    assert (text, reason) == (expected_text, pb.FINISH_REASON_STOP)


def test_a_message_of_several_tokens_ends_at_the_token_that_completed_a_stop_string():
    """A worker that fell behind sends several steps in one message: past a stop string spanning the break, the
    router keeps only the tokens up to the one that completed it, as the engine would have stopped there."""
    req = request(stop=("cd",))  # "c" is token 5, "d" token 6
    tokens = [3, 4, 5, 6, 7, 8]
    expected_text, _ = whole(req, tokens[:4])
    old = IncrementalDetokenizer(LETTERS, req.prompt_token_ids, stop=req.sampling.stop)
    streamed = "".join(old.step([t]) for t in tokens[:3])
    continuation = Continuation(LETTERS, req, [[t] for t in tokens[:3]])
    logprobs = [pb.TokenLogprobs(logprob=-i) for i in range(1, 4)]
    msg = pb.GenerateResponse(token_ids=tokens[3:], text="?", logprobs=logprobs)  # "d", "e", "f" in one message
    continuation.rewrite(msg)
    assert list(msg.token_ids) == [6] and msg.finish_reason == pb.FINISH_REASON_STOP
    assert list(msg.logprobs) == logprobs[:1]  # one per token kept
    assert streamed + msg.text == expected_text


def test_a_stop_token_after_the_break_adds_no_text_as_the_engine_leaves_its_own_out():
    """The engine ends on a stop token without its text: the router's rewrite of a continuation does the same,
    releasing what the detokenizer held back before it."""
    req = replace(request(), sampling=SamplingParams(max_tokens=10, stop_token_ids=(7,)))  # "e" is token 7
    continuation = Continuation(LETTERS, req, [[3], [4]])
    msg = pb.GenerateResponse(token_ids=[5, 7], text="?", finish_reason=pb.FINISH_REASON_STOP)
    continuation.rewrite(msg)
    assert msg.text == "c" and list(msg.token_ids) == [5, 7]

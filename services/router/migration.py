"""A stream that moves to another decode worker after tokens reached the client: the prompt plus the tokens
already streamed is prefilled again and decoding goes on from there, max_tokens reduced by what was streamed.

The new decode worker's detokenizer starts fresh on that longer prompt, so the router re-derives the text of the
continuation itself: an `IncrementalDetokenizer` over the original prompt, fed the streamed tokens in the chunks
the client got, then the continuation's. Text the old worker still held back (half a character, the start of a
possible stop string) and stop strings spanning the break come out exactly as in an unfailed run. The workers
are told how many of the prompt's tokens were streamed (`resumed_output_tokens`), so presence and frequency
penalties count them as output, as the failed worker did. Greedy and seeded output is what an unfailed run gives (a
seeded token's noise is its seed's and position's alone, engine/seeded_noise.py), up to a near-tie of two scores that
the recomputed KV's rounding could flip; an unseeded sampled one continues validly from the tokens streamed.
"""

from __future__ import annotations

from dataclasses import replace

from tokenizers import Tokenizer

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.v1 import generate_pb2 as pb
from services.router.request import RoutedRequest


def continued_request(original: RoutedRequest, streamed: list[int]) -> RoutedRequest:
    sampling = replace(original.sampling, max_tokens=original.sampling.max_tokens - len(streamed))
    return replace(
        original,
        prompt_token_ids=original.prompt_token_ids + streamed,
        sampling=replace(sampling, prompt_logprobs=None),  # the client has them from the first message
        resumed_output_tokens=original.resumed_output_tokens + len(streamed),
    )


class Continuation:
    """Rewrites the continuation's messages as the original stream's detokenizer would have written them."""

    def __init__(self, decoder: Tokenizer, original: RoutedRequest, chunks: list[list[int]]) -> None:
        self._detok = IncrementalDetokenizer(decoder, original.prompt_token_ids, stop=original.sampling.stop)
        self._stop_tokens = set(original.sampling.stop_token_ids)
        for chunk in chunks:
            self._detok.step(chunk)

    def rewrite(self, msg: pb.GenerateResponse) -> None:
        """The engine's rule: a stop string ends the stream with STOP (even one the new worker could not see,
        spanning the break), and the message keeps only the tokens up to the one that completed it (a message
        can carry several); a stop token adds no text; any other finish releases the held-back text."""
        text, kept = "", 0
        for token in msg.token_ids:
            kept += 1
            if token in self._stop_tokens:  # the last the engine sent
                break
            text += self._detok.step([token])
            if self._detok.stopped:
                break
        if self._detok.stopped:
            del msg.token_ids[kept:]
            del msg.logprobs[kept:]
            msg.finish_reason = pb.FINISH_REASON_STOP
        elif msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            text += self._detok.flush()
        msg.text = text

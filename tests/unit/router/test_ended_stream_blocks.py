"""A decode worker's free KV blocks count back what its last report showed our streams that ended since holding: their
prompt and the tokens that had come back by then, not their prompt alone, and never what the report did not count."""

from __future__ import annotations

import time

from pdserve.protocol.sampling import SamplingParams
from services.router.request import RoutedRequest
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, prompt, worker

BLOCKS = 65  # tiny-random's whole context, 1040 tokens, in 16-token blocks


def streaming(r: Router, prompt_tokens: int, max_tokens: int) -> Ticket:
    """A ticket whose first token is back: its prompt's blocks reserved on its decode worker."""
    tokens = prompt(prompt_tokens)
    req = RoutedRequest("client", tokens, SamplingParams(max_tokens=max_tokens), 0.0, 0.0, 0)
    t = Ticket("key", "client", req, r.admit(tokens, max_tokens), 0.0, r.tracker, r.admission)
    t.prefilled()
    t.streamed(1)
    return t


def report(free: int):
    """The decode worker's state as it samples it now."""
    time.sleep(0.01)
    sampled = worker("d0", "decode", kv_blocks_total=BLOCKS, kv_blocks_free=free, load_at=time.time())
    time.sleep(0.01)
    return sampled


def test_a_long_answer_that_ended_gives_back_every_block_the_report_showed_it_holding():
    """A 5-token prompt for 1036 tokens had 956 back (60 blocks, and the one kept for its next: 4 free) when its worker
    sampled its load; once it ended, a request needing all 65 fits. Counted back as its prompt's block alone, the
    worker looked 5 free until its next report, and such a request was shed for up to 0.44 s after every answer."""
    r = Router([worker("p0"), worker("d0", "decode")])
    with streaming(r, 5, 1036) as t:
        t.streamed(955)
        sampled = report(free=BLOCKS - 60 - 1)
        assert r.predictor.free_blocks(sampled) == 4
        t.streamed(80)
    assert r.predictor.free_blocks(sampled) == BLOCKS


def test_a_stream_its_worker_freed_before_its_report_is_not_counted_back_again():
    """Its last token reached us after the worker sampled its load, which no longer counted the stream: the report's
    free blocks are all there is, whether it was alone or another of ours held 20 blocks (19 and its next's)."""
    r = Router([worker("p0"), worker("d0", "decode")])
    with streaming(r, 5, 1036) as t:
        t.streamed(600)
        sampled = report(free=BLOCKS)
    assert r.predictor.free_blocks(sampled) == BLOCKS
    with streaming(r, 5, 1036) as other:
        other.streamed(299)  # 300 back: 19 blocks
        with streaming(r, 5, 1036) as t:
            t.streamed(600)
            sampled = report(free=BLOCKS - 20)
        assert r.predictor.free_blocks(sampled) == BLOCKS - 20


def test_what_our_running_streams_held_at_a_report_is_kept_and_each_end_takes_its_share_off():
    """Summed once per report (it cost ~0.5 ms a placement over 8 workers of 128 streams each, afresh): a stream
    that ends afterwards takes its share off the sum, so the next ends count back in full, as a fresh sum would."""
    r = Router([worker("p0"), worker("d0", "decode")])
    with streaming(r, 5, 1036) as kept:
        kept.streamed(299)  # 300 back: 19 blocks and its next's
        with streaming(r, 5, 1036) as b:
            b.streamed(99)  # 100 back: 7 blocks and its next's
            with streaming(r, 5, 1036) as a:
                a.streamed(600)
                sampled = report(free=0)
            # `a` ended: what our running streams held then is summed now, `b`'s 8 among it
            assert r.predictor.free_blocks(sampled) == BLOCKS - 20 - 8
        after_b = r.predictor.free_blocks(sampled)  # `b` ended too: its share off the kept sum
        r.tracker._live_held.clear()
        assert after_b == r.predictor.free_blocks(sampled) == BLOCKS - 20

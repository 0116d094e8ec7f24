"""A decode worker's free KV blocks count back what its last report showed our streams that ended since holding: their
prompt and the tokens that had come back by then, not their prompt alone, and never what the report did not count:
not a stream its worker had freed when it sampled the report (its count of sequences freed says so), though it
reached us after."""

from __future__ import annotations

import time

from pdserve.protocol.sampling import SamplingParams
from services.router.request import RoutedRequest
from services.router.ticket import Ticket
from services.router.worker_frees import FreedAt
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


def report(free: int, sequences_freed: int = 0, instance: str = "d0-process", **fields: object):
    """The decode worker's state as it samples it now (having freed `sequences_freed` sequences)."""
    time.sleep(0.01)
    sampled = worker(
        "d0",
        "decode",
        kv_blocks_total=BLOCKS,
        kv_blocks_free=free,
        load_at=time.time(),
        sequences_freed=sequences_freed,
        instance=instance,
        **fields,
    )
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


def test_a_stream_freed_before_the_report_is_not_counted_back_beside_another_routers_streams():
    """Its worker freed it (its 7th freed sequence) and then sampled its load, with another router's stream holding 40
    blocks (39 and its next's); its end reached us after. The report held more than ours, so the cap let it count
    back: 64 free where 25 were (39 over). Its worker's count says the report came after its end: 25. A stream that
    ended after the report (the 8th) is counted back as ever."""
    r = Router([worker("p0"), worker("d0", "decode")])
    with streaming(r, 5, 1036) as t:
        t.streamed(600)  # 601 back: 38 blocks and its next's
        sampled = report(free=BLOCKS - 40, sequences_freed=7)
        t.freed_at = FreedAt("d0-process", 7)
    assert r.predictor.free_blocks(sampled) == BLOCKS - 40
    with streaming(r, 5, 1036) as t:
        t.streamed(600)
        sampled = report(free=BLOCKS - 40 - 39, sequences_freed=7)
        t.freed_at = FreedAt("d0-process", 8)
    assert r.predictor.free_blocks(sampled) == BLOCKS - 40


def test_a_report_of_another_process_of_the_worker_never_held_the_stream():
    """A restart counts its frees from 0 again: a report of the new process sampled at 2 is after a stream the old
    process freed as its 7th, whose blocks the new process never held."""
    r = Router([worker("p0"), worker("d0", "decode")])
    with streaming(r, 5, 1036) as t:
        t.streamed(600)
        sampled = report(free=BLOCKS - 40, sequences_freed=2, instance="d0-restarted")
        t.freed_at = FreedAt("d0-process", 7)
    assert r.predictor.free_blocks(sampled) == BLOCKS - 40


def test_a_stream_freed_before_the_report_leaves_its_place_in_the_batch_counted_once():
    """The report counted 3 sequences, none of them ours any longer; ours ended on the worker before it (its count
    says) and reached us after: the batch holds 3 of 4, not 2 (taking ours off again let a 5th in)."""
    r = Router([worker("p0"), worker("d0", "decode", max_num_seqs=4, sequences=2)])
    with streaming(r, 5, 100) as t:
        sampled = report(free=BLOCKS, sequences_freed=3, max_num_seqs=4, sequences=3)
        t.freed_at = FreedAt("d0-process", 3)
    assert r.predictor.has_batch_room(sampled)
    assert not r.predictor.has_batch_room(sampled, spare=1)

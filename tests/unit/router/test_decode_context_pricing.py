"""A decode step reads every sequence's whole context: TPOT priced at the batch's context and the request's own."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.config import RouterConfig
from services.router.load_tracker import LoadTracker
from services.router.predictor import Predictor
from tests.unit.round_profile import PROFILE
from tests.unit.router.router_builder import Router, prompt, worker


def test_tpot_counts_the_context_the_batch_and_the_request_attend_over():
    """A decode step reads every sequence's whole context: a worker decoding long prompts steps slower than one
    decoding short ones, and a long request slower still. Its used KV blocks say what its batch holds (a decode
    worker shares none); the request counts its prompt and half its max_tokens. A profile without the context term
    (a worker of an earlier build) prices the batch by its size alone, as before."""
    deep = replace(PROFILE, decode_per_context_token_s=1e-5)
    pred = Predictor(RouterConfig(), LoadTracker())
    long_batch = worker("d0", "decode", profile=deep, running=4, kv_blocks_free=4096 - 4 * 375)  # 4 x 6000 tokens
    short_batch = replace(long_batch, kv_blocks_free=4096 - 4 * 4)  # 4 x 64 tokens
    assert pred.tpot_s(long_batch, 2000) == pytest.approx(deep.decode_step_s(5, 4 * 6000 + 2000))
    assert pred.tpot_s(short_batch, 2000) == pytest.approx(deep.decode_step_s(5, 4 * 64 + 2000))
    assert pred.tpot_s(long_batch, 2000) > 3 * pred.tpot_s(short_batch, 100)
    assert pred.decode_wait_s(long_batch) == pytest.approx(deep.decode_step_s(4, 4 * 6000))
    assert pred.idle_tpot_s(long_batch, 2000) == pytest.approx(deep.decode_step_s(1, 2000))
    old = replace(long_batch, profile=PROFILE)
    assert pred.tpot_s(old, 2000) == pytest.approx(PROFILE.decode_step_s(5))
    assert pred.decode_wait_s(old) == pytest.approx(PROFILE.decode_step_s(4))

    placed = Router([worker("p0"), worker("d0", "decode", profile=deep)]).place(prompt(6000), 256, 1.0)
    own = 6000 + 128  # halfway through its output
    assert placed.own_context_tokens == own
    assert placed.predicted_tpot_s == pytest.approx(deep.decode_step_s(1, own))
    assert placed.offer.tpot_s == placed.offer.tpot_now_s == pytest.approx(deep.decode_step_s(1, own))

"""A router places requests only on workers of its own tokenizer (and on those too old to say): to a worker of
another, the ids it tokenized a prompt into are other text (a model of another vocabulary rolled out under routers
still running the old one)."""

from __future__ import annotations

import pytest

from pdserve.engine.model_files import locate_model, tokenizer_folder
from pdserve.engine.tokenizer import Tokenizer
from services.router.placement import NoWorkersError
from tests.unit.router.router_builder import Router, prompt, worker

OURS, THEIRS = "a1a1a1a1a1a1a1a1", "b2b2b2b2b2b2b2b2"


def fleet(ours_queued: int = 0) -> list:
    """A pair of this router's tokenizer and an idle, roomier pair of another's: placement by load alone would
    take the other pair."""
    return [
        worker("p0", tokenizer=OURS, queued_prefill_tokens=ours_queued),
        worker("d0", "decode", tokenizer=OURS),
        worker("p1", tokenizer=THEIRS),
        worker("d1", "decode", tokenizer=THEIRS, kv_blocks_total=8192, kv_blocks_free=8192),
    ]


@pytest.mark.parametrize("policy", ["slo", "round-robin"])
def test_requests_go_only_to_workers_of_the_routers_tokenizer(policy: str) -> None:
    r = Router(fleet(ours_queued=3000), policy=policy, tokenizer=OURS)
    placed = [r.place(prompt(64, seed), 16, 1.0) for seed in range(6)]
    assert {(p.prefill_worker.worker_id, p.decode.worker_id) for p in placed} == {("p0", "d0")}
    assert placed[0].offer.kv_blocks == 4096  # the offer is over its own workers too


def test_a_worker_too_old_to_say_its_tokenizer_is_placed_as_before() -> None:
    r = Router([worker("p0"), worker("d0", "decode")], tokenizer=OURS)
    assert r.place(prompt(64), 16, 1.0).decode.worker_id == "d0"


def test_a_router_too_old_to_say_places_on_any_tokenizer() -> None:
    r = Router(fleet(ours_queued=3000), tokenizer="")
    assert r.place(prompt(64), 16, 1.0).prefill_worker.worker_id == "p1"  # the idle one


def test_workers_of_another_tokenizer_only_are_no_workers_naming_both() -> None:
    r = Router([worker("p1", tokenizer=THEIRS), worker("d1", "decode", tokenizer=THEIRS)], tokenizer=OURS)
    with pytest.raises(NoWorkersError, match=f"tokenizer \\({OURS}\\); others run {THEIRS}: a model of another"):
        r.place(prompt(64), 16, 1.0)


def test_the_digest_tells_tokenizers_apart_and_is_stable() -> None:
    tiny, again = (Tokenizer(tokenizer_folder(locate_model("tiny-random"))) for _ in range(2))
    smollm = Tokenizer(tokenizer_folder(locate_model("smollm2-135m")))
    assert tiny.digest == again.digest and len(tiny.digest) == 16
    assert smollm.digest != tiny.digest

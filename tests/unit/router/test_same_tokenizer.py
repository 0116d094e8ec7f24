"""A router places requests only on workers of its own tokenizer (and on those too old to say): to a worker of
another, the ids it tokenized a prompt into are other text (a model of another vocabulary rolled out under routers
still running the old one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def test_the_digest_is_the_vocabularys_not_the_files(tmp_path: Path) -> None:
    """Two builds may write one vocabulary's tokenizer.json differently (a model cache converted by another
    `tokenizers`): the same digest; a token renamed, or another model's vocabulary, another."""
    tiny = tokenizer_folder(locate_model("tiny-random"))
    written = json.loads((tiny / "tokenizer.json").read_text())
    rewritten, renamed = tmp_path / "rewritten", tmp_path / "renamed"
    for folder in (rewritten, renamed):
        shutil.copytree(tiny, folder)
    (rewritten / "tokenizer.json").write_text(json.dumps(written, indent=4, sort_keys=True))
    last = written["added_tokens"][-1]  # a special token: renamed, the text its id stands for differs
    written["model"]["vocab"]["<|renamed|>"] = written["model"]["vocab"].pop(last["content"])
    last["content"] = "<|renamed|>"
    (renamed / "tokenizer.json").write_text(json.dumps(written))
    digests = [Tokenizer(f).digest for f in (tiny, rewritten, renamed, tokenizer_folder(locate_model("smollm2-135m")))]
    assert digests[0] == digests[1] and len(digests[0]) == 16
    assert len(set(digests)) == 3, digests

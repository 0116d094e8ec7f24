"""A fleet mid-rollout of new weights: a prefill worker refuses a decode worker of other weights or another block
size (its KV means nothing there), so a router pairs workers only within one version (`WorkerState.kv_pairing`),
chooses by predicted cost among such pairs only, never offers a version that has one role alone, sheds with a retry
hint when no pair exists at all, keeps a moving stream on the weights that began it, and moves a request a stale
view paired wrongly without ejecting either healthy worker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from pdserve.errors import OverloadedError, UnavailableError
from pdserve.protocol.perf_profile import PerfProfile
from pdserve.protocol.sampling import SamplingParams
from pdserve.rpc.errors import KV_MISMATCH_KEY
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from services.router.generation import generate
from services.router.placement import Placement, UnpairedError
from services.router.request import RoutedRequest
from tests.unit.router.router_builder import Router, prompt, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

OLD, NEW = "0ld0ld0ld0ld0ld0", "new0new0new0new0"
FAST = PerfProfile(0.001, 1e-5, 1e-10, 0.002, 0.0005)  # ten times faster than the builder's profile


def place(r: Router, **kw: object) -> Placement:
    return asyncio.run(r.placement.place(prompt(40), 8, 1.0, **kw))  # type: ignore[arg-type]


def pair(placed: Placement) -> tuple[str, str]:
    return placed.prefill_worker.worker_id, placed.decode.worker_id


def mixed(old_queued: int = 0, new_queued: int = 0, policy: str = "slo") -> Router:
    """A 2P:2D fleet half rolled: one prefill and one decode worker on each weights, ids and free blocks crossed so
    that a pairing blind to weights would cross them (the lower id's prefill worker, the roomier decode worker;
    round-robin's first of each by id)."""
    return Router(
        [
            worker("p0-new", model_fingerprint=NEW, queued_prefill_tokens=new_queued),
            worker("p1-old", model_fingerprint=OLD, queued_prefill_tokens=old_queued),
            worker("d0-old", "decode", model_fingerprint=OLD, kv_blocks_free=4000),
            worker("d1-new", "decode", model_fingerprint=NEW, kv_blocks_free=1000),
        ],
        policy,
    )


@pytest.mark.parametrize("policy", ["slo", "round-robin"])
def test_a_prefill_worker_is_paired_only_with_a_decode_worker_of_its_own_weights(policy):
    r = mixed(policy=policy)
    pairs = {pair(place(r)) for _ in range(8)}
    assert pairs <= {("p1-old", "d0-old"), ("p0-new", "d1-new")}, pairs


def test_of_the_compatible_pairs_the_one_whose_prefill_worker_answers_first_is_chosen():
    assert pair(place(mixed(old_queued=0, new_queued=20_000))) == ("p1-old", "d0-old")
    assert pair(place(mixed(old_queued=20_000, new_queued=0))) == ("p0-new", "d1-new")


def test_a_block_size_of_its_own_is_another_version_though_the_weights_are_the_same():
    r = Router(
        [
            worker("p16", model_fingerprint=OLD),
            worker("p32", model_fingerprint=OLD, block_size=32, queued_prefill_tokens=20_000),
            worker("d16", "decode", model_fingerprint=OLD, kv_blocks_free=1000),
            worker("d32", "decode", model_fingerprint=OLD, block_size=32),
        ]
    )
    assert pair(place(r)) == ("p16", "d16")  # d32 has the most free blocks: a blind pairing took it
    r.registry.remove("p16")
    placed = place(r)
    assert pair(placed) == ("p32", "d32") and placed.blocks_needed == 2  # (40 + 8) tokens in blocks of 32


def test_a_version_with_one_role_alone_is_never_offered_nor_placed_on():
    """The new prefill worker is up (and ten times faster), its decode worker is not yet: the request goes to the
    old pair, and what an idle cluster offers it is the old pair's, not a TTFT no pair can give."""
    r = Router(
        [
            worker("p-old", model_fingerprint=OLD),
            worker("p-new", model_fingerprint=NEW, profile=FAST),
            worker("d-old", "decode", model_fingerprint=OLD),
        ]
    )
    placed = place(r)
    assert pair(placed) == ("p-old", "d-old")
    alone = Router([worker("p-old", model_fingerprint=OLD), worker("d-old", "decode", model_fingerprint=OLD)])
    assert placed.offer == place(alone).offer


def test_no_pair_at_all_is_a_shed_with_a_retry_hint_after_the_wait_not_unavailable():
    """Live, healthy workers of both roles, none of which may be paired: a rollout between its halves, which ends
    by itself, so a later retry can succeed (RESOURCE_EXHAUSTED), where UNAVAILABLE would say it cannot."""
    r = Router(
        [worker("p-new", model_fingerprint=NEW), worker("d-old", "decode", model_fingerprint=OLD)],
        no_workers_wait_s=0.05,
    )
    with pytest.raises(UnpairedError, match=f"prefill workers {NEW}/16/v3, decode workers {OLD}/16/v3"):
        place(r)
    assert not r.placement.can_place()
    request = RoutedRequest("r", prompt(40), SamplingParams(max_tokens=8), 0.0, 0.0, 0)
    with pytest.raises(OverloadedError, match="a rollout under way") as shed:
        asyncio.run(r.lifecycle().place(request))
    assert (shed.value.retry_after_ms, shed.value.reason) == (50, "unpaired")
    r.registry.publish(worker("d-new", "decode", model_fingerprint=NEW))
    assert r.placement.can_place() and pair(place(r)) == ("p-new", "d-new")


def test_a_moving_stream_goes_only_to_workers_of_the_weights_that_began_it():
    r = mixed(new_queued=20_000)
    for _ in range(4):
        assert pair(place(r, weights=NEW, must_hold=True)) == ("p0-new", "d1-new")  # p1-old answers first
    r.registry.remove("d1-new")
    with pytest.raises(UnavailableError, match=f"runs the weights {NEW}"):
        place(r, weights=NEW, must_hold=True)


class CutAfter(StandInDecode):
    """Streams `cut` tokens, then fails UNAVAILABLE (a decode worker lost mid-stream), `before_cut` run first."""

    def __init__(self, cut: int, before_cut: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.cut = cut
        self.before_cut = before_cut

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.calls += 1
        for i in range(self.cut):
            yield pb.GenerateResponse(token_ids=[3 + i])
        self.before_cut()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "engine thread is down")


async def stream(r: Router, max_tokens: int, telemetry: Telemetry | None = None) -> list[int]:
    req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8] * 10, sampling=pb.SamplingParams(max_tokens=max_tokens))

    async def admitted(ticket: object) -> None:
        pass

    lifecycle = r.lifecycle(telemetry=telemetry) if telemetry else r.lifecycle()
    return [t async for msg in generate(lifecycle, req, {}, lambda: 10.0, admitted) for t in msg.token_ids]


async def test_a_stream_cut_mid_answer_migrates_to_a_decode_worker_of_its_weights_though_others_answer_first():
    """Begun on the old weights; by the cut the old prefill worker is loaded and the new pair idle, where a blind
    migration would go, continuing the old weights' answer with the new weights' tokens."""
    routers: list[Router] = []

    def old_prefill_loaded() -> None:
        routers[0].registry.publish(worker("p-old", model_fingerprint=OLD, queued_prefill_tokens=20_000))
        routers[0].registry.publish(worker("p-new", model_fingerprint=NEW))

    lost, same, other = CutAfter(3, old_prefill_loaded), StandInDecode(), StandInDecode()
    async with serving(lost) as d0, serving(same) as d1, serving(other) as d2:
        r = Router(
            [
                worker("p-old", model_fingerprint=OLD),
                worker("p-new", model_fingerprint=NEW, queued_prefill_tokens=20_000),
                worker("d-old-0", "decode", model_fingerprint=OLD, address=d0),
                worker("d-old-1", "decode", model_fingerprint=OLD, address=d1, kv_blocks_free=1000),
                worker("d-new", "decode", model_fingerprint=NEW, address=d2),
            ]
        )
        routers.append(r)
        tokens = await stream(r, 8)
    assert len(tokens) == 8 and (lost.calls, same.calls, other.calls) == (1, 1, 0)


async def test_a_stream_whose_weights_are_gone_fails_rather_than_continue_on_others():
    lost, other = CutAfter(3), StandInDecode()
    async with serving(lost) as d0, serving(other) as d1:
        r = Router(
            [
                worker("p-old", model_fingerprint=OLD),
                worker("p-new", model_fingerprint=NEW, queued_prefill_tokens=20_000),
                worker("d-old", "decode", model_fingerprint=OLD, address=d0),
                worker("d-new", "decode", model_fingerprint=NEW, address=d1, kv_blocks_free=1000),
            ],
            no_workers_wait_s=0.1,
        )
        with pytest.raises(UnavailableError, match="engine thread is down"):
            await stream(r, 8)
    assert other.calls == 0


class RefusedByItsPrefill(StandInDecode):
    """What a decode worker relays when its prefill worker runs other weights (the registry's view was older than
    that worker's restart onto them): UNAVAILABLE naming the prefill worker, marked as a mismatch."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.calls += 1
        context.set_trailing_metadata(((KV_MISMATCH_KEY, "1"),))
        message = f"prefill worker {request.prefill_address}: KV layout mismatch: decode runs (model, block size) ..."
        await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        yield pb.GenerateResponse()


async def test_a_pair_refused_for_other_weights_is_placed_again_without_ejecting_either_worker():
    wrong, right = RefusedByItsPrefill(), StandInDecode()
    telemetry = Telemetry("test-router")
    async with serving(wrong) as d0, serving(right) as d1:
        r = Router(
            [
                worker("p0"),
                worker("p1", queued_prefill_tokens=20_000),
                worker("d0", "decode", address=d0, kv_blocks_free=4000),
                worker("d1", "decode", address=d1, kv_blocks_free=1000),
            ]
        )
        tokens = await stream(r, 4, telemetry)
    assert len(tokens) == 4 and (wrong.calls, right.calls) == (1, 1)
    ejected = [
        (s.labels["worker_id"], s.value)
        for f in telemetry.registry.collect()
        for s in f.samples
        if s.name == "pdserve_worker_ejections_total"
    ]
    assert ejected == []
    assert not any(r.placement.ejections.ejected(w) for w in r.registry.workers())
    telemetry.shutdown()

"""Workers on hosts whose clocks are not the router's, end to end: a `pdserve up` whose worker actors run with their
wall clock 30 s behind the router's and their monotonic clock a day on (skewed_clock/sitecustomize.py shifts those
processes' clock functions, as another host's would be), with the embedded registry and with Redis. The router lists
the workers, shows their reports' true age, and counts a decode worker's batch once: a report is placed in time on
the router's own clock (the Redis entry's age on Redis's clock, the load's age on the worker's), so the streams this
router placed before the report are not counted again on top of it. And routers whose clocks disagree share their
moving streams and KV claims in Redis's time: another router's, 30 s behind or ahead, hold as long as they should.
A worker's Redis entry is heard when Redis says it was written, whatever the writer's wall clock says; retirements and
prefix-index placements are scored on Redis's clock, whichever host writes them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.cluster.local_process import ClusterProcess
from pdserve.registry.base import RETIRED_KEEP_S
from pdserve.registry.redis import PREFIX, RETIRED_KEY, RedisRegistry, worker_key
from pdserve.registry.redis_prefix import RedisPrefixIndex, prefix_key
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.kv_claims import KVClaims
from services.router.load_tracker import LoadTracker
from services.router.shared_claims import SharedKVClaims
from services.router.shared_moving import SharedMoving
from tests.integration.cluster_view import status_json
from tests.integration.skewed_clock.other_router import CLAIMED_BLOCKS, MOVING
from tests.integration.test_redis_registry import router_view, state
from tests.redis_server import RedisServer, emptied, started

pytestmark = pytest.mark.timeout(400)
SKEW_DIR = Path(__file__).parent / "skewed_clock"
SKEW_S = -30.0
CAP = 3  # the decode worker's batch: two streams held, a third request must find its place


server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)


class Skewed:
    def __init__(self, cluster: ClusterProcess, redis: RedisServer | None) -> None:
        self.cluster, self.redis = cluster, redis


@pytest.fixture(scope="module", params=["embedded", "redis"])
def skewed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Skewed]:
    redis = RedisServer() if request.param == "redis" else None
    args = ["--model", "tiny-random", "--prefill", "1", "--decode", "1", "--kv-cache-gb", "0.05"]
    args += ["--max-num-seqs", str(CAP)]
    if redis is not None:
        redis.start()
        args += ["--redis", redis.url]
    env = {"PYTHONPATH": os.pathsep.join([str(SKEW_DIR), os.environ.get("PYTHONPATH", "")])}
    env["PDSERVE_TEST_CLOCK_SKEW_S"] = str(SKEW_S)
    log = tmp_path_factory.mktemp(f"clock_skew_{request.param}") / "cluster.log"
    try:
        cluster = ClusterProcess(*args, log_path=log, env=env)
    except BaseException:
        if redis is not None:
            redis.stop()
        raise
    yield Skewed(cluster, redis)
    cluster.stop()
    if redis is not None:
        redis.stop()


def test_the_hook_runs_a_ray_worker_process_on_skewed_clocks(tmp_path: Path) -> None:
    """What the cluster below rests on: a process started as a Ray worker gets the shifted clocks, others do not."""
    probe = "import time; print(time.time(), time.monotonic())"
    script = tmp_path / "default_worker.py"
    script.write_text(probe)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SKEW_DIR), os.environ.get("PYTHONPATH", "")])}
    env["PDSERVE_TEST_CLOCK_SKEW_S"] = str(SKEW_S)
    wall, mono = time.time(), time.monotonic()
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
    shifted_wall, shifted_mono = map(float, out.stdout.split())
    assert shifted_wall - wall == pytest.approx(SKEW_S, abs=5) and shifted_mono - mono > 86000
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert float(out.stdout.split()[0]) - wall == pytest.approx(0, abs=5)


def test_workers_whose_clocks_are_behind_are_listed_with_their_reports_true_age(skewed: Skewed) -> None:
    """The embedded registry took a worker's own stamp for when it was heard: 30 s behind, no worker was ever
    listed. Status read the age of a Redis entry off the worker's clock against the router's: 30 s."""
    if skewed.redis is not None:  # the workers really write on a clock 30 s behind
        entry = json.loads(skewed.redis.client().get(worker_key("decode-1")) or "{}")
        assert entry["updated_at"] - time.time() == pytest.approx(SKEW_S, abs=5)
    workers = status_json(skewed.cluster.address)["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"], workers
    assert all(0 <= w["state_age_s"] < 3 for w in workers), workers


def request(max_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=sampling)


async def tokens(stub: generate_pb2_grpc.GenerationStub, max_tokens: int) -> int:
    return sum([len(msg.token_ids) async for msg in stub.Generate(request(max_tokens), timeout=30)])


async def test_a_report_of_streams_placed_before_it_is_not_counted_twice(skewed: Skewed) -> None:
    """Two streams hold two of the decode batch's three places, and a report shows them: the third request has its
    place. Read on the router's wall clock, a report sampled on a clock 30 s behind looked 30 s old, so every
    stream placed in those 30 s counted on top of it (2 + 2 of 3: shed with RESOURCE_EXHAUSTED)."""
    async with channel(skewed.cluster.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        assert await tokens(stub, 4) == 4  # warm: channels and the KV rendezvous made
        held = [stub.Generate(request(4000)) for _ in range(CAP - 1)]
        try:
            for call in held:
                assert (await call.read()).token_ids  # streaming: each holds a place in the batch
            end = time.monotonic() + 15
            while not any(w["role"] == "decode" and w["running"] >= CAP - 1 for w in await _workers(skewed)):
                assert time.monotonic() < end, "no report showed the held streams"
                await asyncio.sleep(0.2)
            assert await tokens(stub, 4) == 4
        except grpc.aio.AioRpcError as e:
            pytest.fail(f"{e.code()}: {e.details()}; workers {await _workers(skewed)}")
        finally:
            for call in held:
                call.cancel()


async def _workers(skewed: Skewed) -> list[dict]:
    return (await asyncio.to_thread(status_json, skewed.cluster.address))["workers"]


@pytest.mark.parametrize("skew_s", [SKEW_S, -SKEW_S])
async def test_another_routers_moving_streams_and_claims_hold_as_long_as_they_should(skew_s: float, url: str) -> None:
    """Another router, its clock 30 s behind (or ahead), shares three moving streams and a claim on d0 that lapse
    4 s on: this router counts them at once, and no more 4.5 s later. On the routers' own clocks, those of a router
    behind read lapsed 26 s ago (and the claim was deleted), those of one ahead held 34 s."""
    lapse_s = 4.0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SKEW_DIR), os.environ.get("PYTHONPATH", "")])}
    env |= {"PDSERVE_TEST_CLOCK_SKEW_S": str(skew_s), "PDSERVE_TEST_SKEWED_SCRIPT": "other_router.py"}
    script = SKEW_DIR / "other_router.py"
    await asyncio.to_thread(subprocess.run, [sys.executable, str(script), url, str(lapse_s)], env=env, check=True)
    tracker, claims = LoadTracker(), KVClaims()
    moving, shared = SharedMoving(url, tracker), SharedKVClaims(url, claims)
    try:
        assert await moving.sync() and await shared.sync()
        assert (tracker.moving_elsewhere, claims.held_from("d0", 2)) == (MOVING, CLAIMED_BLOCKS)
        await asyncio.sleep(lapse_s + 0.5)
        assert await moving.sync() and await shared.sync()
        assert (tracker.moving_elsewhere, claims.held_from("d0", 2)) == (0, 0)
    finally:
        await moving.close()
        await shared.close()


async def test_an_entry_is_heard_when_written_by_redis_clock_whatever_the_writers_clocks_say(url, server):
    """Two workers whose wall clocks are 30 s behind and ahead of the router's: each entry is placed in time on the
    router's own clock from its age on Redis's (the TTL it was written with less its PTTL), and its load's from the
    age the worker measured on its own monotonic clock."""
    publisher = RedisRegistry(url, ttl_s=5.0)
    async with router_view(url, refresh_s=3600) as router:
        written = time.monotonic()
        for worker_id, skew_s in (("behind", -30.0), ("ahead", 30.0)):
            at = time.time() + skew_s  # its wall clock, as its own stamps say it, stepped 5 s on since the sample:
            publisher.publish(state(worker_id, updated_at=at, load_at=at - 5.25, load_age_s=0.25))  # 0.25 s ago
        await asyncio.sleep(0.3)  # the entries age 0.3 s in Redis before the router reads them
        assert await router.refresh()
        read = time.monotonic()
        for w in router.workers():
            assert written <= w.heard_at <= read - 0.3, (w.worker_id, w.heard_at - written, read - written)
            assert w.load_sampled_at == pytest.approx(w.heard_at - 0.25)
    with server.client() as c:  # an entry of a build before its TTL was written: its wall clock against ours
        c.set(f"{PREFIX}:worker:older", state("older", updated_at=time.time() - 1.0).to_json(), px=5000)
        c.sadd(f"{PREFIX}:workers", "older")
    async with router_view(url, refresh_s=3600) as router:
        (older,) = (w for w in router.workers() if w.worker_id == "older")
        assert time.monotonic() - older.heard_at == pytest.approx(1.0, abs=0.2)


def on_other_host(skew_s: float, *args: str) -> None:
    """skewed_clock/other_host.py, its wall clock `skew_s` off this machine's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SKEW_DIR), os.environ.get("PYTHONPATH", "")])}
    env |= {"PDSERVE_TEST_CLOCK_SKEW_S": str(skew_s), "PDSERVE_TEST_SKEWED_SCRIPT": "other_host.py"}
    subprocess.run([sys.executable, str(SKEW_DIR / "other_host.py"), *args], env=env, check=True)


@pytest.mark.parametrize("skew_s", [2 * RETIRED_KEEP_S, -2 * RETIRED_KEEP_S])
def test_a_retirement_is_recorded_on_redis_clock_whatever_the_retiring_hosts_clock(url, server, skew_s) -> None:
    """Each retired id is kept its hour. On the retiring host's clock, one 2 h ahead trimmed every other record (its
    hour ago was an hour on), and one 2 h behind wrote a record that the next retirement on a true clock trimmed."""
    here = RedisRegistry(url)
    here.retire("before")
    on_other_host(skew_s, "retire", url, "skewed")
    here.retire("after")
    with server.client() as c:
        scores = dict(c.zrange(RETIRED_KEY, 0, -1, withscores=True))
        seconds, micros = c.time()
    assert sorted(scores) == [b"after", b"before", b"skewed"]
    assert all(0 <= seconds + micros / 1e6 - score < 10 for score in scores.values()), scores


@pytest.mark.parametrize("skew_s", [SKEW_S, -SKEW_S])
async def test_a_trim_keeps_the_newest_placement_whichever_routers_clock_is_off(url, server, skew_s) -> None:
    """Two routers place a prompt each on one worker, one after the other, into an entry that holds one placement:
    the later is kept. On the routers' own clocks, the later lost whenever it came from a router 30 s behind the
    other (it ranked older), or the earlier from one 30 s ahead."""
    earlier, later = [bytes([1, i]) * 8 for i in range(3)], [bytes([2, i]) * 8 for i in range(3)]
    skewed_first = skew_s > 0

    async def place(block_hashes: list[bytes], skewed: bool) -> None:
        if skewed:
            args = ["place", url, "w/1", str(len(block_hashes)), *(h.hex() for h in block_hashes)]
            return await asyncio.to_thread(on_other_host, skew_s, *args)
        index = RedisPrefixIndex(url, max_blocks_per_worker=len(block_hashes))
        index.record("w/1", block_hashes)
        await index.close()

    await place(earlier, skewed=skewed_first)
    await asyncio.sleep(0.01)
    await place(later, skewed=not skewed_first)
    with server.client() as c:
        assert sorted(c.zrange(prefix_key("w/1"), 0, -1)) == sorted(later)

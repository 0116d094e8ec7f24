"""How a router's per-request work and its background reads grow with the number of workers.

Registers N synthetic workers (N/2 prefill, N/2 decode, each with a profile, a load, and on the prefill workers a
prefix-cache entry holding a shared 512-token system prompt and 2000 blocks of their own) in the in-memory registry
and in a real redis-server this script starts, then times, per request, on the router's own classes:

- `place`: SLOAwarePlacement.place (candidates, predictions per worker, the offer, the prefix match)
- `admit`: Admission.check_feasible + check_load on that placement
- `match`: the prefix index's match alone (Redis: its round trips; the Redis CPU it costs, from INFO commandstats)
- `index_bytes_per_held`: what the prefix index holds in Redis (INFO memory's used_memory, filled less empty) per
  block a worker holds; `holders_bytes_per_block`: the holders' bitmaps alone (MEMORY USAGE), per block indexed

and per view refresh of the Redis registry (what every router does every 0.25 s, half the entries rewritten since the
last by their workers' heartbeats): its time on the router's loop, its Redis CPU and the bytes Redis sends. Each
figure is the median over rounds taken alternately across N; the ratio column is against N=4 measured in the same run.

    PYTHONPATH=src:. python docs/experiments/router_at_scale/scale_bench.py [--sizes 4,16,64,256] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import redis

from pdserve.config import RouterConfig
from pdserve.engine.cache_journal import PrefixCacheChanges
from pdserve.protocol.compatibility import KV_WIRE_VERSION, WORKER_FEATURES
from pdserve.protocol.perf_profile import PerfProfile
from pdserve.protocol.prefix_hash import prefix_hashes
from pdserve.protocol.roles import Role
from pdserve.registry.base import PrefixIndex, Registry, WorkerState
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.registry.redis import RedisRegistry
from pdserve.registry.redis_prefix import RedisPrefixIndex, apply_changes

try:
    from pdserve.registry import prefix_holders as holders
    from pdserve.registry.redis_prefix import sweep
except ImportError:  # the build before the holders index
    holders, sweep = None, None  # type: ignore[assignment]
from services.router.admission import Admission, SLOTarget
from services.router.load_tracker import LoadTracker
from services.router.placement import SLOAwarePlacement
from services.router.predictor import Predictor

BS = 16
SYSTEM_PROMPT = [(i * 31) % 30000 + 1 for i in range(512)]  # 32 blocks every prefill worker caches
TEAM_PROMPT = [(i * 37) % 30000 + 3 for i in range(512)]  # 32 blocks one prefill worker in 16 caches
OWN_BLOCKS = 2000  # blocks of its own each prefill worker's entry holds besides
IN_FLIGHT_PER_DECODE = 4  # this router's requests on each decode worker, placed within the last second
# SmolLM2-135M on a 2-core CPU, roughly: what a worker's heartbeat carries (the numbers do not change the cost)
FINGERPRINT = uuid.uuid4().hex
PROFILE = PerfProfile(0.012, 3.1e-4, 4.0e-8, 0.021, 0.0012)


def synthetic_worker(i: int, role: Role) -> WorkerState:
    """A worker as its heartbeat describes it: every field set, as a real one's (the JSON is ~1 KB)."""
    now = time.time()
    return WorkerState(
        worker_id=f"{role.value}-{i}",
        role=role,
        address=f"10.1.{i // 200}.{i % 200 + 2}:50051",
        model_fingerprint=FINGERPRINT,  # one model: placement pairs only workers of the same weights
        block_size=BS,
        kv_bytes_per_token=18432,
        kv_blocks_total=16384,
        kv_blocks_free=12000 - 13 * i,
        kv_blocks_cached=3000,
        queued_prefill_tokens=(700 + 37 * i) if role == Role.PREFILL else 0,
        queued_prefill_prompts=2 if role == Role.PREFILL else 0,
        queued_prefill_token_squares=(700 + 37 * i) ** 2 // 2 if role == Role.PREFILL else 0,
        running=0 if role == Role.PREFILL else 6,
        sequences=0 if role == Role.PREFILL else 6,
        max_num_seqs=64,
        profile=PROFILE,
        speed_factor=1.0 + (i % 7) / 50,
        metrics_address=f"10.1.{i // 200}.{i % 200 + 2}:9400",
        pid=1000 + i,
        build="0.1.0+g1234567",
        instance=uuid.uuid4().hex,
        features=WORKER_FEATURES,
        kv_wire_version=KV_WIRE_VERSION,
        load_at=now - 0.2,
        updated_at=now - 0.1,
    )


def fleet(n: int) -> list[WorkerState]:
    return [synthetic_worker(i, Role.PREFILL) for i in range(n // 2)] + [
        synthetic_worker(i, Role.DECODE) for i in range(n - n // 2)
    ]


def cached_blocks(w: WorkerState, i: int) -> list[bytes]:
    own = [30001 + i] + [(w.pid * 100_000 + j) % 30000 + 1 for j in range(OWN_BLOCKS * BS - 1)]  # its own alone
    team = prefix_hashes(TEAM_PROMPT, BS) if i % 16 == 0 else []
    return prefix_hashes(SYSTEM_PROMPT, BS) + team + prefix_hashes(own, BS)


@dataclass
class Figures:
    """Per N: each measure's samples (seconds, or bytes), taken over the rounds."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    def add(self, what: str, value: float) -> None:
        self.samples.setdefault(what, []).append(value)

    def median(self, what: str) -> float:
        return statistics.median(self.samples[what])


class RedisStats:
    """The bench's redis-server's CPU and net bytes, to take differences of."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def read(self) -> tuple[float, float, float]:
        """The server's CPU (µs, its main thread's: a script's commands count once), bytes in, bytes out."""
        cpu: dict[str, Any] = self.client.info("cpu")
        net: dict[str, Any] = self.client.info("stats")
        usec = 1e6 * (cpu["used_cpu_user_main_thread"] + cpu["used_cpu_sys_main_thread"])
        return usec, net["total_net_input_bytes"], net["total_net_output_bytes"]

    def since(self, start: tuple[float, float, float]) -> tuple[float, ...]:
        """What Redis did since `start` (read just after another read), less what a read itself costs."""
        idle = self.read()
        now = self.read()
        return tuple(b - a - (c - b) for a, b, c in zip(start, idle, now, strict=True))


@dataclass
class Setup:
    registry: Registry
    index: PrefixIndex
    policy: SLOAwarePlacement
    admission: Admission
    keys: list[str]
    workers: list[WorkerState]


async def build(backend: str, n: int, url: str, figures: Figures) -> Setup:
    workers = fleet(n)
    registry: Registry
    index: PrefixIndex
    if backend == "memory":
        registry = InMemoryRegistry(ttl_s=3600)
        memory_index = InMemoryPrefixIndex()
        for i, w in enumerate(workers):
            registry.publish(w)
            if w.role == Role.PREFILL:
                memory_index.apply(w.cache_key, PrefixCacheChanges(cached_blocks(w, i), [], whole=True))
        index = memory_index
    else:
        with redis.Redis.from_url(url) as c:
            c.flushall()
            empty = c.info("memory")["used_memory"]
            held: list[bytes] = []
            for i, w in enumerate(workers):
                if w.role == Role.PREFILL:
                    held += cached_blocks(w, i)
                    apply_changes(c, w.cache_key, PrefixCacheChanges(cached_blocks(w, i), [], whole=True))
            while sweep is not None and sweep(c):  # the build before the holders index has none
                pass
            figures.add("index_bytes_per_held", (c.info("memory")["used_memory"] - empty) / len(held))
            if holders is not None:  # the bitmaps alone, per block they index
                per_block = c.memory_usage(holders.BLOCKS_KEY, samples=0) / (c.hlen(holders.BLOCKS_KEY) - 1)
                figures.add("holders_bytes_per_block", per_block)
        # Refreshed by hand (the benchmark times its refresh), not every 0.25 s in the background.
        registry = RedisRegistry(url, ttl_s=3600, refresh_s=3600, timeout_s=5.0)
        for w in workers:
            registry.publish(w)
        await registry.start()
        index = RedisPrefixIndex(url, match_budget_s=10.0)  # never cut: the whole match is what is timed
    config = RouterConfig()
    tracker = LoadTracker()
    for w in workers:
        if w.role == Role.DECODE:
            for _ in range(IN_FLIGHT_PER_DECODE):
                tracker.start(f"{Role.PREFILL.value}-0", w.worker_id, 100, 0.05, 40, 600, 38)
    predictor = Predictor(config, tracker)
    policy = SLOAwarePlacement(registry, index, predictor)
    keys = [w.cache_key for w in workers if w.role == Role.PREFILL]
    return Setup(registry, index, policy, Admission(config, predictor), keys, workers)


async def close(setup: Setup) -> None:
    await setup.index.close()
    if isinstance(setup.registry, RedisRegistry):
        await setup.registry.close()


async def timed(figures: Figures, what: str, reps: int, step: Callable[[], Awaitable[object]]) -> None:
    """The median wall time of `reps` calls, and the router's CPU per call."""
    walls = []
    cpu0 = time.process_time()
    for _ in range(reps):
        t0 = time.perf_counter()
        await step()
        walls.append(time.perf_counter() - t0)
    figures.add(what, statistics.median(walls))
    figures.add(f"{what}_cpu", (time.process_time() - cpu0) / reps)


async def measure(backend: str, n: int, url: str, reps: int, stats: RedisStats, figures: Figures) -> None:
    setup = await build(backend, n, url, figures)
    suffix = [(j * 17) % 30000 + 7 for j in range(512)]
    prompt = SYSTEM_PROMPT + suffix  # 64 blocks, the first 32 held by every prefill worker
    hashes = prefix_hashes(prompt, BS)[: (len(prompt) - 1) // BS]
    few = prefix_hashes(TEAM_PROMPT + suffix, BS)[: (len(prompt) - 1) // BS]  # by one in 16
    slo = SLOTarget(5.0, 0.5, ttft_explicit=False, tpot_explicit=False)
    cached_hits = await setup.index.match(setup.keys, hashes)
    assert set(cached_hits.values()) == {32}, cached_hits
    few_hits = await setup.index.match(setup.keys, few)
    holding = -(-len(setup.keys) // 16)
    assert sorted(few_hits.values(), reverse=True)[: holding + 1] == [32] * holding + [0], few_hits

    async def place() -> object:
        return await setup.policy.place(prompt, 256, 0.5)

    placement = await setup.policy.place(prompt, 256, 0.5)

    async def admit() -> None:
        setup.admission.check_feasible(placement, len(prompt), slo)
        setup.admission.check_load(placement, len(prompt), 0, slo)

    async def match() -> object:
        return await setup.index.match(setup.keys, hashes)

    async def match_few() -> object:
        return await setup.index.match(setup.keys, few)

    for what, step in (("place", place), ("admit", admit), ("match", match), ("match_few", match_few)):
        before = stats.read()
        await timed(figures, what, reps, step)
        usec, bytes_in, bytes_out = stats.since(before)
        if backend == "redis":
            figures.add(f"{what}_redis_usec", usec / reps)
            figures.add(f"{what}_bytes_in", bytes_in / reps)
            figures.add(f"{what}_bytes_out", bytes_out / reps)
    if isinstance(setup.registry, RedisRegistry):
        await time_refresh(setup.registry, setup.workers, max(reps // 4, 5), stats, figures)
    await close(setup)


async def time_refresh(
    registry: RedisRegistry, workers: list[WorkerState], refreshes: int, stats: RedisStats, figures: Figures
) -> None:
    """A router's view refresh as deployed: half the workers' entries rewritten before each (a heartbeat every 0.5 s,
    a refresh every 0.25 s), those writes left out of the figures; Redis's cost and bytes, the same whatever changed,
    from refreshes back to back."""
    walls, cpu = [], 0.0
    for i in range(refreshes):
        now = time.time()
        for w in workers[i % 2 :: 2]:
            registry.publish(replace(w, load_at=now - 0.01, updated_at=now))
        t0, c0 = time.perf_counter(), time.process_time()
        assert await registry.refresh()
        walls.append(time.perf_counter() - t0)
        cpu += time.process_time() - c0
    figures.add("refresh", statistics.median(walls))
    figures.add("refresh_cpu", cpu / refreshes)
    before = stats.read()
    for _ in range(refreshes):
        await registry.refresh()
    usec, _, bytes_out = stats.since(before)
    figures.add("refresh_redis_usec", usec / refreshes)
    figures.add("refresh_bytes_out", bytes_out / refreshes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            if redis.Redis.from_url(url).ping():
                return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


ROWS = [
    ("place", "µs", 1e6),
    ("place_cpu", "µs", 1e6),
    ("admit", "µs", 1e6),
    ("match", "µs", 1e6),
    ("match_cpu", "µs", 1e6),
    ("match_redis_usec", "µs", 1.0),
    ("match_bytes_in", "B", 1.0),
    ("match_bytes_out", "B", 1.0),
    ("match_few", "µs", 1e6),
    ("match_few_cpu", "µs", 1e6),
    ("match_few_redis_usec", "µs", 1.0),
    ("refresh", "µs", 1e6),
    ("refresh_cpu", "µs", 1e6),
    ("refresh_redis_usec", "µs", 1.0),
    ("refresh_bytes_out", "B", 1.0),
    ("index_bytes_per_held", "B", 1.0),
    ("holders_bytes_per_block", "B", 1.0),
]


def report(backend: str, sizes: list[int], by_n: dict[int, Figures]) -> dict[str, dict[int, float]]:
    rows: dict[str, dict[int, float]] = {}
    print(f"\n{backend} registry and prefix index: medians per request (refresh: per view refresh)")
    print(f"{'measure':<22}" + "".join(f"{'N=' + str(n):>18}" for n in sizes))
    for what, unit, scale in ROWS:
        if what not in by_n[sizes[0]].samples:
            continue
        values = {n: by_n[n].median(what) * scale for n in sizes}
        rows[what] = values
        base = values[sizes[0]] or 1.0
        cells = "".join(f"{values[n]:>10.0f} {f'x{values[n] / base:.1f}':>7}" for n in sizes)
        print(f"{what + (' ' + unit if unit else ''):<22}{cells}")
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,16,64,256", help="worker counts, comma-separated; the first is the base")
    parser.add_argument("--reps", type=int, default=60, help="requests timed per measure, N and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds across every N, alternately")
    parser.add_argument("--backends", default="memory,redis")
    parser.add_argument("--json", help="also write the medians here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    proc, url = start_redis()
    results: dict[str, Any] = {"sizes": sizes}
    try:
        stats = RedisStats(redis.Redis.from_url(url))
        for backend in args.backends.split(","):
            by_n = {n: Figures() for n in sizes}
            for _ in range(args.rounds):
                for n in sizes:
                    await measure(backend, n, url, args.reps, stats, by_n[n])
            results[backend] = report(backend, sizes, by_n)
    finally:
        proc.kill()
        proc.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())

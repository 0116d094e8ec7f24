"""What a fleet costs its shared Redis in the background: commands, bytes and Redis CPU per second, for R routers and N
workers (N/2 prefill, N/2 decode) at the default intervals, plus what each request adds.

First each unit of background work is measured alone, on the real classes against a real redis-server (INFO
commandstats, INFO stats' net bytes, INFO cpu, before and after K repeats): a prefill and a decode worker's heartbeat
(RedisRegistry.publish, and a prefill worker's prefix-cache journal, apply_changes), a router's view refresh at N
workers, its KV-claims and moving-streams syncs, its admitted-totals flush, and per request the prefix match and the
placement's record. The model multiplies them by their rates (heartbeat 0.5 s; refresh, claims, moving 0.25 s;
admitted 1 s). Then `--run` starts R routers' background tasks and N workers' heartbeats for real, together, for
`--seconds`, and prints what Redis saw beside what the model predicts for that R and N.

    PYTHONPATH=src:. python docs/experiments/router_at_scale/fleet_redis_load.py --model-for 8x256 --run 2x16,4x64
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import redis
from scale_bench import BS, SYSTEM_PROMPT, cached_blocks, fleet, start_redis

from pdserve.engine.cache_journal import PrefixCacheChanges
from pdserve.protocol.admitted import AdmittedTotals
from pdserve.protocol.prefix_hash import prefix_hashes
from pdserve.protocol.roles import Role
from pdserve.registry.base import WorkerState
from pdserve.registry.redis import RedisRegistry
from pdserve.registry.redis_prefix import RedisPrefixIndex, apply_changes
from services.router.admitted import ClusterAdmitted
from services.router.kv_claims import KVClaims
from services.router.load_tracker import LoadTracker
from services.router.shared_claims import SharedKVClaims
from services.router.shared_moving import SharedMoving

HEARTBEAT_S, REFRESH_S, ADMITTED_S = 0.5, 0.25, 1.0
UNIT_TIMEOUT_S = 5.0  # each unit's own calls: a pause of this 2-core VM must not fail the measure (a run keeps 0.25 s)


@dataclass(frozen=True)
class Cost:
    """What Redis saw: commands (a script's own included), bytes in and out, its CPU in µs."""

    commands: float = 0.0
    bytes_in: float = 0.0
    bytes_out: float = 0.0
    cpu_us: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(self.row(), other.row(), strict=True)))

    def __mul__(self, k: float) -> Cost:
        return Cost(*(a * k for a in self.row()))

    def row(self) -> tuple[float, float, float, float]:
        return self.commands, self.bytes_in, self.bytes_out, self.cpu_us


def snapshot(client: redis.Redis) -> tuple[Cost, dict[str, int]]:
    """Redis's totals so far (INFO's own calls left out), and the calls per command."""
    commands: dict[str, Any] = client.info("commandstats")
    stats: dict[str, Any] = client.info("stats")
    cpu: dict[str, Any] = client.info("cpu")
    calls = {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in commands.items() if name != "cmdstat_info"}
    used = 1e6 * (cpu["used_cpu_user_main_thread"] + cpu["used_cpu_sys_main_thread"])
    return Cost(sum(calls.values()), stats["total_net_input_bytes"], stats["total_net_output_bytes"], used), calls


async def unit(client: redis.Redis, repeats: int, step: Callable[[], Awaitable[object] | object]) -> Cost:
    """The cost of one `step`, the mean of `repeats`, less what reading INFO itself cost (its replies' bytes)."""
    idle, _ = snapshot(client)
    before, _ = snapshot(client)
    for _ in range(repeats):
        result = step()
        if asyncio.iscoroutine(result):
            await result
    after, _ = snapshot(client)
    rows = zip(idle.row(), before.row(), after.row(), strict=True)
    return Cost(*((c - b - (b - a)) / repeats for a, b, c in rows))


def beat(worker: WorkerState, n: int) -> WorkerState:
    """The worker's next heartbeat: its load moved, stamped now."""
    now = time.time()
    return replace(worker, kv_blocks_free=worker.kv_blocks_free - n % 5, load_at=now - 0.01, updated_at=now)


def journal(worker: WorkerState, n: int) -> PrefixCacheChanges:
    """A busy prefill worker's beat: a prompt's 8 blocks keyed, 8 evicted."""
    keyed = [f"{worker.worker_id}:{n}:{i}".encode().ljust(16, b".")[:16] for i in range(8)]
    gone = [f"{worker.worker_id}:{n - 1}:{i}".encode().ljust(16, b".")[:16] for i in range(8)]
    return PrefixCacheChanges(keyed, gone)


def publish(registry: RedisRegistry, worker: WorkerState, n: int) -> None:
    """What a worker's heartbeat thread writes (worker_runtime.WorkerRuntime._heartbeat)."""
    registry.publish(beat(worker, n))
    if worker.role == Role.PREFILL:
        apply_changes(registry.client, worker.cache_key, journal(worker, n))


async def measure_units(url: str, n: int, repeats: int) -> dict[str, Cost]:
    client = redis.Redis.from_url(url)
    client.flushall()
    workers = fleet(n)
    writer = RedisRegistry(url, ttl_s=3600, timeout_s=UNIT_TIMEOUT_S)
    for i, w in enumerate(workers):
        writer.publish(w)
        if w.role == Role.PREFILL:
            apply_changes(client, w.cache_key, PrefixCacheChanges(cached_blocks(w, i), [], whole=True), first=True)
    prefill, decode = workers[0], workers[-1]
    counter = iter(range(1, 1 << 30))
    costs = {
        "heartbeat, prefill": await unit(client, repeats, lambda: publish(writer, prefill, next(counter))),
        "heartbeat, decode": await unit(client, repeats, lambda: publish(writer, decode, next(counter))),
    }
    # Refreshed by hand: a refresh in the background would land its bytes in the other units' figures.
    router = RedisRegistry(url, ttl_s=3600, refresh_s=3600, timeout_s=UNIT_TIMEOUT_S)
    await router.start()
    tracker, claims = LoadTracker(), KVClaims()
    shared_claims, moving = SharedKVClaims(url, claims), SharedMoving(url, tracker)
    local = AdmittedTotals()
    admitted = ClusterAdmitted(router, local)

    async def flush() -> None:
        local.requests += 1
        await admitted.flush()

    costs["router view refresh"] = await unit(client, repeats, router.refresh)
    costs["router KV claims sync"] = await unit(client, repeats, shared_claims.sync)
    costs["router moving sync"] = await unit(client, repeats, moving.sync)
    costs["router admitted flush"] = await unit(client, repeats, flush)
    index = RedisPrefixIndex(url, match_budget_s=10.0)
    keys = [w.cache_key for w in workers if w.role == Role.PREFILL]
    prompt = prefix_hashes(SYSTEM_PROMPT + list(range(7, 519)), BS)
    cold = prefix_hashes(list(range(3, 1027)), BS)
    costs["request: prefix match, held by all"] = await unit(client, repeats, lambda: index.match(keys, prompt[:63]))
    costs["request: prefix match, held by none"] = await unit(client, repeats, lambda: index.match(keys, cold[:63]))

    async def record() -> None:
        index.record(keys[0], prompt)
        await index.flush()

    costs["request: placement recorded"] = await unit(client, repeats, record)
    await index.close()
    await router.close()
    writer.client.close()
    client.close()
    return costs


def model(units: dict[str, Cost], routers: int, n: int) -> Cost:
    """Background cost per second of `routers` routers over `n` workers, at the default intervals."""
    prefill, decode = n // 2, n - n // 2
    every_refresh = units["router view refresh"] + units["router KV claims sync"] + units["router moving sync"]
    per_router = every_refresh * (1 / REFRESH_S) + units["router admitted flush"] * (1 / ADMITTED_S)
    workers = (units["heartbeat, prefill"] * prefill + units["heartbeat, decode"] * decode) * (1 / HEARTBEAT_S)
    return per_router * routers + workers


async def run_fleet(url: str, routers: int, n: int, seconds: float) -> tuple[Cost, dict[str, int]]:
    """R routers' background tasks and N workers' heartbeats, together, for `seconds`: Redis's cost per second and
    its calls per command per second."""
    client = redis.Redis.from_url(url)
    client.flushall()
    workers = fleet(n)
    writer = RedisRegistry(url, ttl_s=3600)
    for i, w in enumerate(workers):
        writer.publish(w)
        if w.role == Role.PREFILL:
            apply_changes(client, w.cache_key, PrefixCacheChanges(cached_blocks(w, i), [], whole=True), first=True)
    stop = threading.Event()
    failed: list[Exception] = []

    def heartbeats(mine: list[WorkerState]) -> None:
        registry = RedisRegistry(url, ttl_s=3600)  # one client per thread, as each worker has its own
        beats = 0
        while not stop.wait(HEARTBEAT_S):
            beats += 1
            for w in mine:
                try:
                    publish(registry, w, beats)
                except redis.RedisError as e:  # as a worker's heartbeat: counted, and the next beat goes on
                    failed.append(e)
        registry.client.close()

    parts: list[Any] = []
    for _ in range(routers):
        registry = RedisRegistry(url, ttl_s=3600)
        await registry.start()
        tracker, claims = LoadTracker(), KVClaims()
        shared_claims, moving = SharedKVClaims(url, claims), SharedMoving(url, tracker)
        await shared_claims.start()
        await moving.start()
        admitted = ClusterAdmitted(registry, AdmittedTotals(requests=1))
        admitted.start()
        parts.append((registry, shared_claims, moving, admitted))
    threads = 8
    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(heartbeats, workers[i::threads]) for i in range(threads)]
        await asyncio.sleep(1.0)  # every loop under way
        before, calls_before = snapshot(client)
        t0 = time.monotonic()
        for _ in range(int(seconds)):
            await asyncio.sleep(1.0)
            for *_, admitted in parts:
                admitted.local.requests += 1  # each router admits a request a second: its flush writes
        after, calls_after = snapshot(client)
        elapsed = time.monotonic() - t0
        stop.set()
        for f in futures:
            f.result()
    for registry, shared_claims, moving, admitted in parts:
        await admitted.close()
        await moving.close()
        await shared_claims.close()
        await registry.close()
    writer.client.close()
    client.close()
    rate = Cost(*((a - b) / elapsed for a, b in zip(after.row(), before.row(), strict=True)))
    calls = {c: round((calls_after[c] - calls_before.get(c, 0)) / elapsed) for c in calls_after}
    calls["failed heartbeats"] = len(failed)
    return rate, {c: k for c, k in sorted(calls.items(), key=lambda kv: -kv[1]) if k}


def show(label: str, cost: Cost) -> str:
    commands, bytes_in, bytes_out, cpu = cost.row()
    return f"{label:<44}{commands:>10.0f}{bytes_in / 1e3:>12.1f}{bytes_out / 1e3:>12.1f}{cpu / 1e3:>12.2f}"


HEADER = f"{'':<44}{'commands':>10}{'KB in':>12}{'KB out':>12}{'CPU ms':>12}"


def shape(text: str) -> tuple[int, int]:
    routers, workers = text.split("x")
    return int(routers), int(workers)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=40, help="of each unit, measured alone")
    parser.add_argument("--model-for", default="8x64,8x256", help="ROUTERSxWORKERS, comma-separated")
    parser.add_argument("--run", default="", help="ROUTERSxWORKERS to run together for real, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    modelled = [shape(text) for text in args.model_for.split(",")]
    runs = [shape(text) for text in filter(None, args.run.split(","))]
    proc, url = start_redis()
    try:
        units = {n: await measure_units(url, n, args.repeats) for n in sorted({n for _, n in modelled + runs})}
        largest = max(units)
        print(f"each unit alone, {largest} workers registered (per unit):\n{HEADER}")
        for label, cost in units[largest].items():
            print(show(label, cost))
        for n, at_n in units.items():
            if n != largest:
                print(show(f"router view refresh at {n} workers", at_n["router view refresh"]))
        print(f"\nmodel, per second at the default intervals, without requests:\n{HEADER}")
        for routers, n in modelled:
            print(show(f"{routers} routers x {n} workers", model(units[n], routers, n)))
        for routers, n in runs:
            rate, calls = await run_fleet(url, routers, n, args.seconds)
            print(f"\n{routers} routers x {n} workers run together for {args.seconds:g} s, per second:\n{HEADER}")
            print(show("measured", rate))
            print(show("model", model(units[n], routers, n)))
            print("calls/s: " + ", ".join(f"{c} {k}" for c, k in calls.items()))
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    asyncio.run(main())

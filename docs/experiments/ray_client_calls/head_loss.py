"""What a Ray Client's head loss does to an event loop that checks an actor every 0.5 s (as the supervision does).

A Ray head of its own (RayNode, the tests' helper), this process joined to it through `ray://` with a 5 s reconnect
grace, one actor; a call to it whose wait timed out is in flight when the head is SIGKILLed, and the loop goes on
checking every 0.5 s until Ray says the link is gone (or 60 s). A ticker task records the loop's longest stall.
`--plain`: each call is `await asyncio.wait_for(ref, t)` (pdserve before actor_calls); otherwise
`actor_calls.answer`. `--slots-held`: `answer` with 2 thread slots, both held at the kill by calls whose answers
are due after it (a fleet's worth of checks mid-answer). Prints one JSON line: when the link loss was noticed, the
loop's longest stall and the checks' outcomes, or that the loop froze for good.

    PYTHONPATH=.:src .venv/bin/python docs/experiments/ray_client_calls/head_loss.py [--plain | --slots-held]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pdserve.cluster import actor_calls
from pdserve.cluster.actor_calls import answer
from tests.integration.ray_nodes import RayNode, ray_env

GRACE_S = 5
FROZEN_S = 60  # the loop not run this long: frozen (the checks' own bound is 60 s too)


async def checks(actor: Any, head: RayNode, plain: bool, slots_held: bool) -> dict[str, Any]:
    import ray

    longest_stall, last = 0.0, time.monotonic()

    async def ticker() -> None:
        nonlocal longest_stall, last
        while True:
            now = time.monotonic()
            longest_stall, last = max(longest_stall, now - last), now
            await asyncio.sleep(0.05)

    async def check() -> str:
        try:
            if plain:
                await asyncio.wait_for(actor.state.remote(), 1.0)
            else:
                await answer(actor.state, timeout_s=1.0)
            return "answer"
        except Exception as e:
            return type(e).__name__

    tick = asyncio.ensure_future(ticker())
    before = await check()
    if slots_held:  # every slot's call answers 0.5 s after the kill
        held = [asyncio.ensure_future(answer(actor.due, timeout_s=5.0)) for _ in range(actor_calls.MAX_THREADS)]
        await asyncio.sleep(0.5)
    # A call in flight whose wait timed out when the head dies (a check of a slow actor): its answer never comes.
    with contextlib.suppress(TimeoutError):
        if plain:
            await asyncio.wait_for(actor.slow.remote(), 0.5)
        elif not slots_held:
            await answer(actor.slow, timeout_s=0.5)
    head.kill()
    killed, longest_stall, outcomes = time.monotonic(), 0.0, []

    def watchdog() -> None:
        """The loop frozen for good cannot say so itself."""
        while time.monotonic() - last < FROZEN_S:
            time.sleep(1)
        frozen = {"plain": plain, "slots_held": slots_held, "before": before, "loop_frozen_for_s": FROZEN_S}
        print(json.dumps(frozen), flush=True)
        head.stop()
        os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    while ray.is_initialized() and time.monotonic() - killed < 60:
        outcomes.append(await check())
        await asyncio.sleep(0.5)
    tick.cancel()
    if slots_held:
        outcomes += [type(e).__name__ for e in await asyncio.gather(*held, return_exceptions=True)]
    gone = time.monotonic() - killed
    return {
        "plain": plain, "slots_held": slots_held, "before": before,
        "link_lost_noticed_s": round(gone, 1) if gone < 60 else None, "longest_loop_stall_s": round(longest_stall, 2),
        "checks": dict(zip(*_counts(outcomes), strict=True)),
    }  # fmt: skip


def _counts(outcomes: list[str]) -> tuple[list[str], list[int]]:
    kinds = sorted(set(outcomes))
    return kinds, [outcomes.count(k) for k in kinds]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--slots-held", action="store_true")
    args = parser.parse_args()
    if args.slots_held:
        actor_calls.MAX_THREADS = 2
    temp_dir = Path(tempfile.mkdtemp(prefix="head-loss-"))
    env = ray_env(temp_dir) | {"RAY_CLIENT_RECONNECT_GRACE_PERIOD": str(GRACE_S)}
    os.environ.update(env)
    head = RayNode(temp_dir, {"head": 1}, env=env)
    try:
        head.wait_started()
        print(json.dumps(asyncio.run(checks(joined(head), head, args.plain, args.slots_held))), flush=True)
    finally:
        head.stop()  # what the kill left (nothing), or the whole head when a start failed
    os._exit(0)  # a client whose head is gone may block its own shutdown


def joined(head: RayNode) -> Any:
    """This process joined to the head through Ray Client; an actor on it. The head's client proxy now and then fails
    to start a client's server on this loaded machine (as in tests/integration/test_ray_head_restart.py): tried
    again, up to three times."""
    import ray

    for attempt in range(3):
        try:
            ray.init(f"ray://127.0.0.1:{head.client_port}")
            break
        except ConnectionAbortedError:
            if attempt == 2:
                raise

    @ray.remote(num_cpus=0, max_concurrency=4)
    class Actor:
        def state(self) -> int:
            return os.getpid()

        def slow(self) -> None:
            time.sleep(30)

        def due(self) -> int:
            time.sleep(1.0)
            return os.getpid()

    actor = Actor.remote()  # type: ignore[attr-defined]
    ray.get(actor.state.remote())
    return actor


if __name__ == "__main__":
    main()

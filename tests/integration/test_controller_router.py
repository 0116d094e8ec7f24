"""The deployment's process model on this machine (issue 13 item 6, issue 12 item 6): two Ray nodes started with
`ray start`, each with a custom resource of its own; `pdserve controller --role-resources` puts the prefill worker
on one and the decode worker on the other; a separate `pdserve router` serves through a real Redis; the router is
SIGKILLed mid-stream (the decode worker frees the stream's blocks at once) and a new one serves from the same
workers, which were never restarted; a restarted controller finds the workers in its Ray namespace instead of
starting new ones; `pdserve scale` through the router reaches the
controller through Redis (each node has room for a second worker of its role), and a restarted controller keeps
the scale; a one-role scale while Redis lost the counts waits for the controller to write them back; a controller
restarted with other flags rolls the workers onto them, surging each (its role's only worker) under a steady load,
and the controller after it adopts the successors; a controller of a new image rolls them onto a node of that
image, never the old image's (`--build-resources`). The cluster: `rehearsal.py`.

Where this machine allows (root, `ip netns`), each Ray node is a host of its own: a network namespace with its own
address, the workers binding 0.0.0.0 and advertising their node's POD_IP, the router and Redis on a third address
(the root namespace): every request then proves that the advertised addresses are dialled from another host
(router -> decode worker, decode -> prefill worker, prefill -> the decode worker's KV rendezvous). Elsewhere both
nodes share loopback. One set-up for the module (~1-2 min on 2 busy cores).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest
import redis

from pdserve.build import build_resource
from pdserve.cluster.local_process import PdserveProcess, free_port
from pdserve.protocol.compatibility import KV_WIRE_VERSION, WORKER_FEATURES
from pdserve.registry.base import WorkerState
from pdserve.registry.redis import DESIRED_COUNTS_KEY, RETIRED_KEY, worker_key
from pdserve.rpc.client import generate
from pdserve.v1 import generate_pb2 as pb
from tests.integration import netns
from tests.integration.ray_nodes import actor_names
from tests.integration.reference import MAX_TOKENS, PROMPT, greedy_request
from tests.integration.rehearsal import (
    BUILD,
    NAMESPACE,
    NEXT_BUILD,
    WORKERS,
    Rehearsal,
    image_node,
    rehearsal_cluster,
    serve,
    serve_at,
    started,
)
from tests.integration.steady_load import assert_all_served, steady_load
from tests.integration.worker_view import idle, workers

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def rehearsal() -> Iterator[Rehearsal]:
    with rehearsal_cluster() as r:
        yield r


def test_each_role_runs_on_its_own_ray_node(rehearsal: Rehearsal) -> None:
    actors = rehearsal.actors()
    assert actors["prefill-0"]["node_resources"] == sorted(["pdserve_prefill", build_resource(BUILD)]), actors
    assert actors["decode-1"]["node_resources"] == sorted(["pdserve_decode", build_resource(BUILD)]), actors
    assert {a["state"] for a in actors.values()} == {"ALIVE"}
    registry = rehearsal.registry()
    assert sorted(registry) == sorted(WORKERS)
    for w in registry.values():  # never a wildcard
        assert not w.address.startswith(("0.0.0.0", "[::]")), w
        assert w.build == BUILD  # its node's, as its pod's PDSERVE_BUILD names it
        assert (w.features, w.kv_wire_version) == (WORKER_FEATURES, KV_WIRE_VERSION)  # what routers pair it by


def test_each_worker_advertises_its_own_hosts_address(rehearsal: Rehearsal, expected: list[int]) -> None:
    """Workers bind 0.0.0.0 and advertise their node's POD_IP; the router (another host) and the prefill worker
    (the KV rendezvous on the decode worker's host) dial exactly those addresses, or no request is served."""
    if rehearsal.network is None:
        pytest.skip(f"no network namespaces here ({netns.unavailable()}): both Ray nodes share loopback")
    hosts = dict(zip(WORKERS, (ip for _, ip in rehearsal.network.hosts), strict=True))
    for worker_id, w in rehearsal.registry().items():
        assert w.address.rpartition(":")[0] == hosts[worker_id], w
        assert w.metrics_address.rpartition(":")[0] == hosts[worker_id], w
    assert serve(rehearsal, "rehearsal-across-hosts") == expected


def test_the_router_serves_through_redis(rehearsal: Rehearsal, expected: list[int]) -> None:
    assert serve(rehearsal, "rehearsal-first") == expected


def test_a_deadline_passing_while_kv_bytes_flow_fails_no_other_request(
    rehearsal: Rehearsal, expected: list[int]
) -> None:
    """A caller's deadline that passes while its KV is on the wire ends that request, not the transfer: the wire's
    deadline is the configured transfer timeout, never the caller's time left, so the (prefill, decode) pair is
    not broken under the next request's transfer queued behind it (which is served without being placed again),
    and both workers free the blocks once the bytes have landed. The prefill host's link is slowed to 2 Mbit/s:
    a 2000-token tiny-random KV (~1 MB) then takes ~4 s."""
    if rehearsal.network is None:
        pytest.skip(f"no network namespaces here ({netns.unavailable()}): no link to slow")
    assert rehearsal.router is not None and rehearsal.head_netns is not None  # the prefill worker's host
    router = f"127.0.0.1:{rehearsal.router_port}"
    slow = greedy_request("rehearsal-deadline-on-the-wire", [5, 6, 7, 8, 9] * 400, MAX_TOKENS)

    async def deadline_then_next() -> tuple[grpc.StatusCode | None, list[int]]:
        first = asyncio.ensure_future(status_of(router, slow, timeout_s=1.5))
        await asyncio.sleep(0.5)  # its transfer is on the wire
        return await first, await serve_at(router, "rehearsal-behind-the-slow-transfer")

    placed_again = rehearsal.router.log().count("placed again")
    with netns.slow_link(rehearsal.head_netns, "2mbit"):
        code, tokens = asyncio.run(deadline_then_next())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert tokens == expected
    assert rehearsal.router.log().count("placed again") == placed_again, rehearsal.router.log()[-3000:]
    end = time.monotonic() + 30
    while not all(idle(w) for w in asyncio.run(workers(router))):
        assert time.monotonic() < end, asyncio.run(workers(router))
        time.sleep(0.2)


async def status_of(router: str, req: pb.GenerateRequest, timeout_s: float) -> grpc.StatusCode | None:
    """The call's status code; None when it completed."""
    try:
        async for _ in generate(router, req, timeout_s):
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return None


def test_a_killed_router_is_replaced_and_the_workers_keep_serving(rehearsal: Rehearsal, expected: list[int]) -> None:
    """Killed mid-stream: its caller gets UNAVAILABLE, and the decode worker frees the stream's blocks at once (its
    call's connection is gone), not once the stream would have ended (4000 tokens: many seconds of decoding)."""
    before = rehearsal.actors()
    assert rehearsal.router is not None
    router, long = f"127.0.0.1:{rehearsal.router_port}", greedy_request("rehearsal-cut-by-its-router", PROMPT, 4000)

    async def killed_mid_stream() -> grpc.StatusCode | None:
        assert rehearsal.router is not None
        try:
            async for msg, _ in generate(router, long, timeout_s=60):
                if msg.token_ids and rehearsal.router.proc.poll() is None:
                    rehearsal.router.stop(signal.SIGKILL)  # no drain, no goodbye: as a lost pod
        except grpc.aio.AioRpcError as e:
            return e.code()
        return None

    assert asyncio.run(killed_mid_stream()) == grpc.StatusCode.UNAVAILABLE
    killed, decode = time.monotonic(), next(w for w in WORKERS if w.startswith("decode"))
    while (state := rehearsal.registry()[decode]).kv_blocks_used or state.sequences:  # as it heartbeats into Redis
        assert time.monotonic() - killed < 5, state
        time.sleep(0.1)
    rehearsal.start_router()
    assert serve(rehearsal, "rehearsal-after-router-restart") == expected
    after = rehearsal.actors()
    for worker_id in WORKERS:  # the same processes, never restarted
        assert (after[worker_id]["pid"], after[worker_id]["restarts"]) == (before[worker_id]["pid"], 0)


def test_a_restarted_controller_finds_its_workers(rehearsal: Rehearsal, expected: list[int]) -> None:
    before = rehearsal.actors()
    assert rehearsal.controller is not None
    rehearsal.controller.stop(signal.SIGTERM)  # leaves the detached actors serving
    assert rehearsal.controller.proc.returncode == 0, rehearsal.controller.log()[-3000:]
    assert "leaving workers prefill-0, decode-1 running" in rehearsal.controller.log()
    assert serve(rehearsal, "rehearsal-without-controller") == expected
    flags = list(rehearsal.controller_args)
    rehearsal.controller_args += ["--log-level", "DEBUG"]  # the workers take it where they run: none restarts
    log = rehearsal.start_controller().log()
    rehearsal.controller_args = flags  # the next controller's INFO: they take that back the same way
    for worker_id in WORKERS:
        assert f"worker {worker_id} ready at" in log and f"found running in Ray namespace {NAMESPACE}" in log
    end = time.monotonic() + 30
    while not all(f"worker {w} logs at DEBUG now" in log for w in WORKERS):
        assert time.monotonic() < end, log[-3000:]
        time.sleep(0.5)
        log = rehearsal.controller.log()
    after = rehearsal.actors()
    assert {w: a["pid"] for w, a in after.items()} == {w: a["pid"] for w, a in before.items()}
    assert serve(rehearsal, "rehearsal-after-controller-restart") == expected


def test_a_scale_through_the_router_reaches_the_controller_and_outlives_its_restart(
    rehearsal: Rehearsal, expected: list[int]
) -> None:
    router = f"127.0.0.1:{rehearsal.router_port}"
    done = scale(rehearsal, router, "--prefill", "2", "--wait", "--timeout", "240")
    assert done.returncode == 0, done.stdout + done.stderr
    actors = rehearsal.actors()
    assert "pdserve_prefill" in actors["prefill-2"]["node_resources"] and actors["prefill-2"]["state"] == "ALIVE"
    with rehearsal.redis.client() as r:
        assert r.hgetall(DESIRED_COUNTS_KEY) == {b"prefill": b"2", b"decode": b"1"}
    assert serve(rehearsal, "rehearsal-scaled") == expected
    assert rehearsal.controller is not None
    rehearsal.controller.stop(signal.SIGTERM)
    log = rehearsal.start_controller().log()
    assert "kept from the registry" in log  # not the flags' 1 prefill worker
    settled = scale(rehearsal, router, "--prefill", "2", "--wait", "--timeout", "240")  # no change: waits only
    assert settled.returncode == 0, settled.stdout + settled.stderr
    assert rehearsal.actors()["prefill-2"]["pid"] == actors["prefill-2"]["pid"]  # adopted, not started again
    done = scale(rehearsal, router, "--prefill", "1", "--wait", "--timeout", "240")
    assert done.returncode == 0, done.stdout + done.stderr
    end = time.monotonic() + 60
    while sorted(rehearsal.actors()) != sorted(WORKERS):  # the newer of two idle workers left; Ray marks it dead
        assert time.monotonic() < end, rehearsal.actors()
        time.sleep(1)
    with rehearsal.redis.client() as r:  # removed for good: routers stop counting it as a restart to wait for
        assert r.zrange(RETIRED_KEY, 0, -1) == [b"prefill-2"]
    assert serve(rehearsal, "rehearsal-scaled-back") == expected


def test_a_one_role_scale_after_redis_lost_the_counts_waits_for_the_controller_to_write_them_back(
    rehearsal: Rehearsal,
) -> None:
    """A Redis restarted empty holds no desired counts until the controller writes its own back (within a second).
    A scale naming one role meanwhile has no count to keep for the other: the router answers RESOURCE_EXHAUSTED
    with a retry hint and `pdserve scale` asks again. Before, INVALID_ARGUMENT ("decode: must be 1 to 64, got 0")."""
    assert rehearsal.controller is not None
    controller = rehearsal.controller.proc
    controller.send_signal(signal.SIGSTOP)  # so the counts stay lost until the scale has been refused
    try:
        with rehearsal.redis.client() as r:
            r.delete(DESIRED_COUNTS_KEY)
        argv = [sys.executable, "-m", "pdserve.cli", "scale", "--addr", f"127.0.0.1:{rehearsal.router_port}"]
        asking = subprocess.Popen(
            [*argv, "--decode", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **rehearsal.env},
        )
        time.sleep(4)  # the CLI's start, and a refusal or two
        assert asking.poll() is None, asking.communicate()[0]
    finally:
        controller.send_signal(signal.SIGCONT)
    out, _ = asking.communicate(timeout=60)
    assert asking.returncode == 0, out
    with rehearsal.redis.client() as r:
        assert r.hgetall(DESIRED_COUNTS_KEY) == {b"prefill": b"1", b"decode": b"1"}
    assert "restored the fleet's" in rehearsal.controller.log()


def scale(rehearsal: Rehearsal, router: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdserve.cli", "scale", "--addr", router, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, **rehearsal.env})


def test_a_controller_restarted_with_new_flags_rolls_its_workers_onto_them(
    rehearsal: Rehearsal, expected: list[int]
) -> None:
    """A new controller revision (here another SIGTERM drain budget) adopts the running workers, then rolls each onto
    the new spec instead of leaving the old configuration serving. Each is its role's only worker, so each is
    surged (its successor serves before it drains): a steady load through the rollout loses no request. The next
    controller adopts the successors, whose ids the flags do not name, instead of starting the flags' workers."""
    before = rehearsal.actors()
    assert rehearsal.controller is not None
    rehearsal.controller.stop(signal.SIGTERM)
    rehearsal.controller_args += ["--worker-drain-timeout-s", "45"]
    controller, outcomes = asyncio.run(_roll_under_load(rehearsal, set(WORKERS), "rollout-"))
    log = controller.log()
    for worker_id in WORKERS:
        assert f"worker {worker_id} runs an earlier spec (drain_timeout_s differ); starting its successor first" in log
        assert f"worker {worker_id} removed" in log
    successors = rehearsal.actors()
    assert all(
        a["state"] == "ALIVE" and a["pid"] not in {b["pid"] for b in before.values()} for a in successors.values()
    )
    assert len(outcomes) >= 10
    assert_all_served(outcomes, expected)
    end = time.monotonic() + 60
    while set(rehearsal.registry()) != set(successors) or any(w.draining for w in rehearsal.registry().values()):
        assert time.monotonic() < end, rehearsal.registry()
        time.sleep(0.5)
    assert serve(rehearsal, "rehearsal-after-rollout") == expected

    controller.stop(signal.SIGTERM)
    log = rehearsal.start_controller().log()
    for worker_id in successors:
        assert f"worker {worker_id} ready at" in log
    assert log.count(f"found running in Ray namespace {NAMESPACE}") == len(successors)
    assert {w: a["pid"] for w, a in rehearsal.actors().items()} == {w: a["pid"] for w, a in successors.items()}
    assert serve(rehearsal, "rehearsal-after-adoption") == expected


async def _roll_under_load(rehearsal: Rehearsal, old: set[str], prefix: str) -> tuple[PdserveProcess, list]:
    """Starts the controller under a steady 2 req/s and waits until every worker of `old` has a successor and is
    gone; the controller and every request's outcome."""
    stop = asyncio.Event()
    load = asyncio.create_task(steady_load(f"127.0.0.1:{rehearsal.router_port}", stop, 2.0, prefix, PROMPT, MAX_TOKENS))
    controller = await asyncio.to_thread(rehearsal.start_controller)
    end = time.monotonic() + 180
    while set(actors := await asyncio.to_thread(rehearsal.actors)) & old or len(actors) != len(old):
        assert time.monotonic() < end, controller.log()[-3000:]
        await asyncio.sleep(1)
    stop.set()
    return controller, await load


def test_a_controller_of_a_new_image_rolls_its_workers_onto_that_images_nodes(
    rehearsal: Rehearsal, expected: list[int]
) -> None:
    """A Helm upgrade to a new image with the same flags: the new controller (its PDSERVE_BUILD the new image) rolls
    the workers it adopts, which still run the old one, as it rolls new flags. With `--build-resources` the
    successors start only on a node of the new image (a KubeRay pod that Ray's autoscaler adds; here a Ray node
    started with that image's build resource), never on the old image's nodes beside them, which keep room for
    more; each worker then reports the new build, and a steady load loses no request."""
    ns, ip = rehearsal.network.hosts[1] if rehearsal.network else (None, "127.0.0.1")
    roles = {"pdserve_prefill": 1, "pdserve_decode": 1}
    head, temp_dir, pod_ip = rehearsal.nodes[0].address, rehearsal.temp_dir, rehearsal.network is not None
    rehearsal.nodes.append(
        started(lambda: image_node(temp_dir, roles, head, ip, ns, rehearsal.env, pod_ip, NEXT_BUILD))
    )
    before = rehearsal.actors()
    assert rehearsal.controller is not None
    rehearsal.controller.stop(signal.SIGTERM)
    rehearsal.build = NEXT_BUILD
    controller, outcomes = asyncio.run(_roll_under_load(rehearsal, set(before), "new-image-"))
    log = controller.log()
    for worker_id in before:
        assert f"worker {worker_id} runs an earlier spec (build {BUILD!r} -> {NEXT_BUILD!r} differ)" in log, log[-3000:]
    successors = rehearsal.actors()
    for worker_id, actor in successors.items():
        assert build_resource(NEXT_BUILD) in actor["node_resources"], (worker_id, actor)
    assert_all_served(outcomes, expected)
    end = time.monotonic() + 60
    while {w: s.build for w, s in rehearsal.registry().items()} != dict.fromkeys(successors, NEXT_BUILD):
        assert time.monotonic() < end, rehearsal.registry()
        time.sleep(0.5)
    assert serve(rehearsal, "rehearsal-after-new-image") == expected


def test_a_sigkilled_pdserve_up_leaves_its_workers_to_a_router(rehearsal: Rehearsal, expected: list[int]) -> None:
    """Issue 12 item 6 with `pdserve up --ray-address`: its actors are detached in its own Ray namespace, so when
    the process (router and supervision) dies, a `pdserve router` on the same Redis serves from the same workers."""
    url = rehearsal.redis.url.removesuffix("/0") + "/1"  # a registry of its own beside the controller's
    port = free_port()
    args = ["up", "--model", "tiny-random", "--ray-address", rehearsal.nodes[0].address, "--redis", url]
    args += ["--ray-namespace", "pdserve-up", "--port", str(port), "--threads", "1", "--kv-cache-gb", "0.05"]
    if rehearsal.network:
        args += ["--bind-host", "0.0.0.0"]  # its router too: the test dials it from the root namespace
    up = PdserveProcess(*args, log_path=rehearsal.temp_dir / "up.log", env=rehearsal.env, netns=rehearsal.head_netns)
    rehearsal.started.append(up)
    up.wait_ready()
    with redis.Redis.from_url(url) as r:
        before = {w: WorkerState.from_json(r.get(worker_key(w))).address for w in WORKERS}
    up.stop(signal.SIGKILL)
    router = PdserveProcess(
        "router",
        "--model",
        "tiny-random",
        "--redis",
        url,
        "--port",
        str(port),
        log_path=rehearsal.temp_dir / "r.log",
        env=rehearsal.env,  # the cluster secret `up`'s workers took
    )
    rehearsal.started.append(router)
    router.wait_ready()
    tokens = asyncio.run(serve_at(f"127.0.0.1:{port}", "after-up-was-killed"))
    assert tokens == expected
    with redis.Redis.from_url(url) as r:  # a restarted worker would have bound a new free port
        assert {w: WorkerState.from_json(r.get(worker_key(w))).address for w in WORKERS} == before


def test_a_sigtermed_pdserve_up_stops_the_workers_it_was_starting(rehearsal: Rehearsal) -> None:
    """SIGTERM while `pdserve up --ray-address` starts its workers: it exits cleanly and removes its detached actors,
    which would otherwise wait in Ray for good. Its build's resource is on no node, so they never start."""
    namespace = "pdserve-up-stopped"
    args = ["up", "--model", "tiny-random", "--ray-address", rehearsal.nodes[0].address, "--build-resources"]
    args += ["--ray-namespace", namespace, "--port", str(free_port()), "--kv-cache-gb", "0.05"]
    env = {**rehearsal.env, "PDSERVE_BUILD": "registry.example/pdserve:on-no-node"}
    up = PdserveProcess(*args, log_path=rehearsal.temp_dir / "up-stopped.log", env=env, netns=rehearsal.head_netns)
    rehearsal.started.append(up)

    def names() -> list[str]:
        return actor_names(rehearsal.nodes[0].address, namespace, rehearsal.env, netns=rehearsal.head_netns)

    end = time.monotonic() + 120
    while names() != sorted(WORKERS):
        assert up.proc.poll() is None and time.monotonic() < end, up.log()[-3000:]
        time.sleep(1.0)
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=60) == 0, up.log()[-3000:]
    assert not re.search(r"^ready ", up.log(), re.MULTILINE)
    end = time.monotonic() + 20  # Ray records a kill a moment after it is asked
    while (left := names()) and time.monotonic() < end:
        time.sleep(1.0)
    assert left == []

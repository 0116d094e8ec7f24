"""Live scaling through a real `pdserve up` (tiny-random, 1 prefill + 1 decode), under load:
- ScaleWorkers refuses counts the cluster cannot take, naming the field, and a dry run refuses them too;
- `pdserve scale --addr` to 2P:2D and back to 1P:1D while greedy requests keep coming: none fails, every output is
  the single-process engine's, the status shows the counts, the new workers take requests, the removed workers
  drained (not replaced), and at the end every KV block is free (through Redis and a separate controller:
  test_controller_router.py);
- `scale --kubernetes --addr` (against a stand-in for the Kubernetes API and KubeRay) adds a pod before its worker
  and deletes only the pods the drained workers left empty;
- `pdserve autoscale` adds a prefill worker while a prefill-heavy load (long prompts, four output tokens) arrives
  and gives it back once the load is gone; `--once` prints one decision and exits.

The first load's requests hold their prefill worker for a moment before the KV send (PDSERVE_FAULT_KV_SEND_DELAY_S),
so a prefill worker that drains has hand-offs to finish. The autoscaler plans with a hand-written profile (a slow
prefill: one worker sustains ~2.5 of these prompts a second) so its decisions follow the load it sees, not the
speed of this machine. The tests run in file order on one cluster.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace

import grpc
import pytest

from pdserve.cluster.local_process import ClusterProcess
from pdserve.planner.kube_fleet import ScaleRefused, scale_pods_and_workers
from pdserve.planner.kube_scale import GROUPS, WorkerPod
from pdserve.planner.live_scale import serving_counts
from pdserve.rpc.credentials import ClientCredentials
from pdserve.rpc.server import channel
from pdserve.v1 import admin_pb2, admin_pb2_grpc
from tests.integration.reference import PROMPT, greedy, greedy_request
from tests.integration.steady_load import assert_all_served, steady_load, tokens
from tests.integration.worker_view import idle
from tests.unit.planner.json_patch import apply_json_patch
from tests.unit.planner.synthetic import PERF, synthetic_profile

pytestmark = pytest.mark.timeout(400)
LOAD_TOKENS = 32
LOAD = "load-"  # the scale test's requests: a prefill worker holds each 0.3 s between its first token and KV send
LONG_PROMPT = list(range(3, 253)) + list(range(3, 153))  # 400 tokens
HEAVY_TOKENS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("scale") / "cluster.log"
    args = ["--model", "tiny-random", "--kv-cache-gb", "0.05", "--prefill", "1", "--decode", "1"]
    faults = {"PDSERVE_FAULT_KV_SEND_DELAY_S": "0.3", "PDSERVE_FAULT_REQUEST_ID_PREFIX": LOAD}
    proc = ClusterProcess(*args, log_path=log, env=faults)
    yield proc
    proc.stop()


async def status(router: str) -> admin_pb2.ClusterStatusResponse:
    async with channel(router) as ch:
        return await admin_pb2_grpc.AdminStub(ch).ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=5)


async def until(router: str, cond, timeout_s: float) -> admin_pb2.ClusterStatusResponse:
    end = time.monotonic() + timeout_s
    while not cond(s := await status(router)):
        assert time.monotonic() < end, s
        await asyncio.sleep(0.5)
    return s


def at_counts(prefill: int, decode: int, idle_too: bool = False):
    """Exactly these workers, all serving (none draining away), and, `idle_too`, holding no KV block."""
    want = {"prefill": prefill, "decode": decode}

    def check(s: admin_pb2.ClusterStatusResponse) -> bool:
        all_ready = len(s.workers) == prefill + decode and serving_counts(s) == want
        return all_ready and dict(s.desired) == want and (not idle_too or all(idle(w) for w in s.workers))

    return check


async def cli(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.cli", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


def test_counts_the_cluster_cannot_take_are_invalid_argument_naming_the_field(cluster):
    async def scale(**counts: int) -> grpc.aio.AioRpcError:
        async with channel(cluster.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await admin_pb2_grpc.AdminStub(ch).ScaleWorkers(admin_pb2.ScaleWorkersRequest(**counts), timeout=5)
        return e.value

    async def run() -> None:
        for counts, field in (({"prefill": 65, "decode": 2}, "prefill"), ({"colocated": 2}, "colocated")):
            e = await scale(**counts)
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(field), e.details()
        assert dict((await status(cluster.address)).desired) == {"prefill": 1, "decode": 1}  # nothing changed

    asyncio.run(run())


def test_a_dry_run_refuses_what_the_router_refuses_and_changes_nothing(cluster):
    """It printed `1 prefill, 1 decode -> 1 prefill, 1 decode, 2 colocated`, exit 0, for a scale the router refuses."""

    async def run() -> None:
        code, out = await cli("scale", "--addr", cluster.address, "--colocated", "2", "--dry-run")
        assert code == 2 and "--colocated: this cluster is disaggregated: set prefill and decode" in out, out
        code, out = await cli("scale", "--addr", cluster.address, "--prefill", "3", "--dry-run")
        assert code == 0 and "desired: 1 prefill, 1 decode -> 3 prefill, 1 decode" in out, out
        assert dict((await status(cluster.address)).desired) == {"prefill": 1, "decode": 1}

    asyncio.run(run())


def test_two_scales_of_different_roles_at_once_both_hold(cluster):
    """Each names only its role; the router changes only that one (it once wrote both, the other's as read before
    the other scale landed, so the later call undid the earlier)."""

    async def scale(**counts: int) -> admin_pb2.ScaleWorkersResponse:
        async with channel(cluster.address) as ch:
            request = admin_pb2.ScaleWorkersRequest(**counts)
            return await admin_pb2_grpc.AdminStub(ch).ScaleWorkers(request, timeout=5)

    async def run() -> None:
        await asyncio.gather(*(scale(prefill=2) if i % 2 else scale(decode=2) for i in range(6)))
        assert dict((await status(cluster.address)).desired) == {"prefill": 2, "decode": 2}
        await scale(prefill=1, decode=1)
        await until(cluster.address, at_counts(1, 1), 120)

    asyncio.run(run())


async def scale_up_and_down_under_load(cluster: ClusterProcess, expected: list[int]) -> None:
    await until(cluster.address, at_counts(1, 1, idle_too=True), 60)
    stop = asyncio.Event()
    load = asyncio.create_task(steady_load(cluster.address, stop, 4, LOAD, PROMPT, LOAD_TOKENS))
    code, out = await cli("scale", "--addr", cluster.address, "--prefill", "2", "--decode", "2", "--wait")
    assert code == 0, out
    assert "desired: 1 prefill, 1 decode -> 2 prefill, 2 decode" in out and "serving: 2 prefill, 2 decode (" in out
    up = await until(cluster.address, at_counts(2, 2), 10)
    new = {w.id for w in up.workers} - {"prefill-0", "decode-1"}

    def served_by_every_new_worker(s: admin_pb2.ClusterStatusResponse) -> bool:  # the router's latencies per worker
        return all(w.ttft_p50_ms > 0 or w.tpot_p50_ms > 0 for w in s.workers if w.id in new)

    # In placement: they take what the old ones cannot. The steady load's one prompt is cached on the old prefill
    # worker, which the router rightly keeps it on while that worker keeps up; prompts arriving together, none of
    # them cached, queue there and spill onto the new one.
    burst = [[3 + i, *PROMPT[1:]] for i in range(8)]
    answers = await asyncio.gather(
        *(tokens(cluster.address, greedy_request(f"burst-{i}", p, 4)) for i, p in enumerate(burst))
    )
    assert answers == [greedy(p, 4) for p in burst]
    await until(cluster.address, served_by_every_new_worker, 30)
    code, out = await cli("scale", "--addr", cluster.address, "--decode", "1", "--prefill", "1", "--wait")
    assert code == 0, out
    await asyncio.sleep(1)  # requests placed on the remaining workers only
    stop.set()
    outcomes = await load
    assert_all_served(outcomes, expected)
    print(f"{len(outcomes)} requests while scaling 1P:1D -> 2P:2D -> 1P:1D, all served")
    down = await until(cluster.address, at_counts(1, 1, idle_too=True), 60)  # every KV block free
    gone = {w.id for w in up.workers} - {w.id for w in down.workers}
    assert len(gone) == 2
    end = time.monotonic() + 20  # Ray forwards a worker's log lines with a delay
    while not all(drained_line(cluster.log(), w) for w in gone) and time.monotonic() < end:
        await asyncio.sleep(0.5)
    log = cluster.log()
    for worker_id in gone:
        assert f"worker {worker_id} removed (scaled down)" in log
        assert f"worker {worker_id} drained; a new actor takes its place" not in log  # not restarted
        m = drained_line(log, worker_id)
        assert m is not None and int(m.group(3)) == 0, log[-3000:]
        print(f"{worker_id} held {m.group(1)} requests when it drained, moved {m.group(2)}")


def drained_line(log: str, worker_id: str) -> re.Match[str] | None:
    return re.search(rf"worker {worker_id} drained in .*?: held (\d+) requests, (\d+) moved; (\d+) KV", log)


def test_scaling_up_and_back_down_under_steady_load_loses_nothing(cluster):
    asyncio.run(scale_up_and_down_under_load(cluster, greedy(PROMPT, LOAD_TOKENS)))


def test_autoscale_adds_a_prefill_worker_under_prefill_heavy_load_and_gives_it_back(cluster, tmp_path):
    profile = tmp_path / "profile.json"
    synthetic_profile(perf=replace(PERF, prefill_per_token_s=0.0008)).save(profile)
    expected = greedy(LONG_PROMPT, HEAVY_TOKENS)
    flags = ["--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--max-workers", "3", "--interval", "0.5"]
    flags += ["--window", "3", "--consecutive", "2", "--cooldown", "3"]
    autoscale = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "autoscale", "--addr", cluster.address, "--profile", str(profile)]
        + flags,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    async def run() -> None:
        await until(cluster.address, at_counts(1, 1, idle_too=True), 60)
        stop = asyncio.Event()
        load = asyncio.create_task(steady_load(cluster.address, stop, 4, "heavy-", LONG_PROMPT, HEAVY_TOKENS))
        start = time.monotonic()
        try:
            await until(cluster.address, at_counts(2, 1), 120)
            print(f"2 prefill workers serving {time.monotonic() - start:.1f} s after the load began")
        finally:
            stop.set()
            outcomes = await load
        assert_all_served(outcomes, expected)
        start = time.monotonic()
        await until(cluster.address, at_counts(1, 1, idle_too=True), 120)
        print(f"back to 1 prefill worker {time.monotonic() - start:.1f} s after the load ended")

    try:
        asyncio.run(run())
    finally:
        autoscale.send_signal(signal.SIGINT)
        out, _ = autoscale.communicate(timeout=30)
        print(out[-3000:])
    scales = [json.loads(line) for line in out.splitlines() if line.startswith("{") and '"action": "scale"' in line]
    assert [s["recommended"] for s in scales] == [{"prefill": 2, "decode": 1}, {"prefill": 1, "decode": 1}], out
    assert scales[0]["load"]["input_len"] == len(LONG_PROMPT)


@pytest.mark.timeout(120)
def test_autoscale_stops_cleanly_on_sigterm(cluster, tmp_path):
    """A pod's stop: SIGTERM between decisions ends the loop with status 0 (it used to kill it mid-step)."""
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    flags = ["--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--max-workers", "3", "--interval", "0.2"]
    flags += ["--window", "0.4", "--dry-run"]
    autoscale = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "autoscale", "--addr", cluster.address, "--profile", str(profile)]
        + flags,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert autoscale.stdout is not None
        assert autoscale.stdout.readline().startswith("{")  # a first decision: the loop runs
        autoscale.send_signal(signal.SIGTERM)
        assert autoscale.wait(timeout=15) == 0
    finally:
        autoscale.kill()
        autoscale.communicate()


def test_autoscale_once_prints_one_decision_and_exits(cluster, tmp_path):
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    flags = ["--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--max-workers", "3"]
    flags += ["--interval", "0.5", "--window", "1"]
    argv = ["autoscale", "--addr", cluster.address, "--profile", str(profile), *flags, "--once", "--dry-run"]
    code, out = asyncio.run(cli(*argv))
    assert code == 0, out
    decisions = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(decisions) == 1, out
    assert decisions[0]["action"] == "hold" and decisions[0]["recommended"] == {"prefill": 1, "decode": 1}
    assert decisions[0]["load"]["rate"] == 0  # idle: no request came in its window
    other = synthetic_profile()
    other.meta["model"] = "smollm2-135m"  # this cluster serves tiny-random: the router says so in its status
    other.save(profile)
    code, out = asyncio.run(cli(*argv))
    assert code == 2 and "the profile was measured on model 'smollm2-135m', the cluster serves 'tiny-random'" in out


class KubeRayStandIn:
    """The Kubernetes API and KubeRay as `scale --kubernetes --addr` sees them (the one external system here): a
    RayCluster of this cluster's groups, which JSON patches change, and its worker pods, which follow its replicas
    as KubeRay's controller makes them follow (the pods named in workersToDelete go, then the first listed; a new
    pod gets a fresh IP). The pods hosting this cluster's workers have their host's IP, 127.0.0.1. Each patch
    records the workers the router lists at that moment, per role (draining ones too)."""

    def __init__(self, router: str, replicas: dict[str, int], autoscaling: bool = False) -> None:
        self.router = router
        groups = [{"groupName": g, "replicas": replicas[g], "minReplicas": 1, "maxReplicas": 8} for g in GROUPS]
        self.live = {"spec": {"enableInTreeAutoscaling": autoscaling, "workerGroupSpecs": groups}}
        self.pods = [WorkerPod(f"{g}-{i}", g, "127.0.0.1", True, False) for g in GROUPS for i in range(replicas[g])]
        self.patches: list[tuple[list[dict], dict[str, int]]] = []
        self._ips = (f"10.0.0.{i}" for i in range(1, 255))

    def get(self) -> dict:
        return self.live

    def patch(self, ops: list[dict]) -> None:
        with grpc.insecure_channel(self.router) as ch:
            listed = admin_pb2_grpc.AdminStub(ch).ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=5).workers
        self.patches.append((ops, dict(Counter(w.role for w in listed))))
        self.live = apply_json_patch(self.live, ops)
        for spec in self.live["spec"]["workerGroupSpecs"]:
            group = spec["groupName"]
            named = set(spec.get("scaleStrategy", {}).get("workersToDelete", []))
            self.pods = [p for p in self.pods if p.name not in named]
            pods = [p for p in self.pods if p.group == group]
            for _ in range(spec["replicas"] - len(pods)):
                self.pods.append(WorkerPod(f"{group}-{len(self.pods)}", group, next(self._ips), True, False))
            for extra in pods[: max(0, len(pods) - spec["replicas"])]:
                self.pods.remove(extra)

    def worker_pods(self) -> list[WorkerPod]:
        return list(self.pods)


def test_scale_with_pods_adds_pods_before_workers_and_deletes_only_pods_left_empty(cluster):
    async def scale(kuberay: KubeRayStandIn, **counts: int) -> list[str]:
        steps: list[str] = []
        credentials = ClientCredentials()
        await scale_pods_and_workers(kuberay, cluster.address, credentials, counts, 120, lambda s, _: steps.append(s))
        return steps

    async def run() -> None:
        await until(cluster.address, at_counts(1, 1, idle_too=True), 60)
        kuberay = KubeRayStandIn(cluster.address, {"prefill": 1, "decode": 1})
        assert await scale(kuberay, decode=2) == ["pods added", "workers serving"]
        ((grown, workers_then),) = kuberay.patches
        assert workers_then == {"prefill": 1, "decode": 1}  # the pod came before its worker
        assert {"op": "replace", "path": "/spec/workerGroupSpecs/1/replicas", "value": 2} in grown
        await until(cluster.address, at_counts(1, 2), 10)
        added = [p.name for p in kuberay.pods if p.ip != "127.0.0.1"]
        assert await scale(kuberay, decode=1) == ["workers serving", "empty pods deleted"]
        shrunk, workers_then = kuberay.patches[-1]
        assert workers_then == {"prefill": 1, "decode": 1}  # the worker drained away before any pod was named
        strategy = {"op": "add", "path": "/spec/workerGroupSpecs/1/scaleStrategy", "value": {"workersToDelete": added}}
        assert strategy in shrunk
        assert [p.name for p in kuberay.pods] == ["prefill-0", "decode-0"]  # the workers' own pods stayed
        await until(cluster.address, at_counts(1, 1, idle_too=True), 60)

        every_pod_busy = KubeRayStandIn(cluster.address, {"prefill": 1, "decode": 2})
        with pytest.raises(ScaleRefused, match="decode: 1 pods must go, but only 0 host no worker"):
            await scale(every_pod_busy, decode=1)
        assert not every_pod_busy.patches
        autoscaled = KubeRayStandIn(cluster.address, {"prefill": 1, "decode": 1}, autoscaling=True)
        with pytest.raises(ScaleRefused, match="autoscaler"):
            await scale(autoscaled, decode=2)
        assert not autoscaled.patches and dict((await status(cluster.address)).desired) == {"prefill": 1, "decode": 1}

    asyncio.run(run())

"""The rehearsal cluster of test_controller_router: the deployment's process model on this machine. Two Ray nodes
started with `ray start` as the chart's worker pods start (a role resource, the image's build resource,
PDSERVE_BUILD and, on a host of its own, POD_IP), Redis, `pdserve controller --role-resources --build-resources`
and a separate `pdserve router`."""

from __future__ import annotations

import asyncio
import secrets
import signal
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.build import build_resource
from pdserve.cluster.local_process import PdserveProcess, free_port
from pdserve.registry.base import WorkerState
from pdserve.registry.redis import WORKERS_KEY, worker_key
from pdserve.rpc.client import generate
from tests.integration import netns
from tests.integration.ray_nodes import RayNode, named_actors, ray_env, remove_temp_dir
from tests.integration.reference import request
from tests.redis_server import RedisServer

NAMESPACE = "pdserve-rehearsal"
WORKERS = ("prefill-0", "decode-1")  # ids count across roles
# The image the module's nodes and first controllers run; a later controller comes with the next one.
BUILD, NEXT_BUILD = "registry.example/pdserve:rehearsal-1", "registry.example/pdserve:rehearsal-2"


@dataclass
class Rehearsal:
    temp_dir: Path
    redis: RedisServer
    nodes: list[RayNode]
    controller_args: list[str]
    env: dict[str, str]
    network: netns.TwoHosts | None
    build: str = BUILD  # the controller's PDSERVE_BUILD (its image, as the chart sets it)
    router_port: int = field(default_factory=free_port)
    controller: PdserveProcess | None = None
    router: PdserveProcess | None = None
    started: list[PdserveProcess] = field(default_factory=list)

    @property
    def head_netns(self) -> str | None:
        return self.network.hosts[0][0] if self.network else None

    def start_controller(self) -> PdserveProcess:
        n = len(self.started)
        self.controller = PdserveProcess(
            *self.controller_args,
            log_path=self.temp_dir / f"controller-{n}.log",
            env={**self.env, "PDSERVE_BUILD": self.build},
            netns=self.head_netns,
        )
        self.started.append(self.controller)
        self.controller.wait_ready()
        return self.controller

    def start_router(self) -> PdserveProcess:
        n = len(self.started)
        args = ["router", "--model", "tiny-random", "--redis", self.redis.url, "--port", str(self.router_port)]
        self.router = PdserveProcess(*args, log_path=self.temp_dir / f"router-{n}.log", env=self.env)
        self.started.append(self.router)
        self.router.wait_ready()
        return self.router

    def actors(self) -> dict[str, dict]:
        return named_actors(self.nodes[0].address, NAMESPACE, self.env, netns=self.head_netns)

    def registry(self) -> dict[str, WorkerState]:
        with self.redis.client() as r:
            listed = sorted(i.decode() for i in r.smembers(WORKERS_KEY))
            return {w: WorkerState.from_json(r.get(worker_key(w))) for w in listed if r.exists(worker_key(w))}


def _start_nodes(temp_dir: Path, env: dict[str, str], network: netns.TwoHosts | None) -> list[RayNode]:
    hosts: list[tuple[str | None, str]] = [(None, "127.0.0.1")] * 2 if network is None else [*network.hosts]
    (ns0, ip0), (ns1, ip1) = hosts

    nodes: list[RayNode] = []
    try:
        hosts_own = network is not None
        nodes.append(started(lambda: image_node(temp_dir, {"pdserve_prefill": 2}, None, ip0, ns0, env, hosts_own)))
        head = nodes[0].address
        nodes.append(started(lambda: image_node(temp_dir, {"pdserve_decode": 2}, head, ip1, ns1, env, hosts_own)))
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


def image_node(
    temp_dir: Path,
    role_resources: dict[str, float],
    head: str | None,
    ip: str,
    ns: str | None,
    env: dict[str, str],
    pod_ip: bool,
    build: str = BUILD,
) -> RayNode:
    """A Ray node as the chart's worker pods start: its role resources, its image's build resource, PDSERVE_BUILD
    naming the image and (on a host of its own) the POD_IP Kubernetes' downward API gives a pod."""
    resources = {**role_resources, build_resource(build): 1}
    node_env = {**env, "PDSERVE_BUILD": build, **({"POD_IP": ip} if pod_ip else {})}
    return RayNode(temp_dir, resources, head, ip, ns, node_env)


def started(new_node: Callable[[], RayNode], attempts: int = 4) -> RayNode:
    """A started node. `ray start` gives a node 30 s (fixed) to register; on this shared 2-core machine under other
    tests' load that is sometimes too little, and a second try with fresh ports succeeds."""
    for attempt in range(1, attempts + 1):
        node = new_node()
        try:
            node.wait_started()
            return node
        except BaseException as e:  # stopped whatever went wrong: a node left running outlives the test run
            node.stop()
            if not isinstance(e, RuntimeError) or attempt == attempts:
                raise
    raise AssertionError("unreachable")


@contextmanager
def rehearsal_cluster() -> Iterator[Rehearsal]:
    """Two Ray nodes (one per role, of the image BUILD), Redis, a controller and a router; all stopped after."""
    temp_dir = Path(tempfile.mkdtemp(prefix="pdrh", dir="/tmp"))  # short: Ray's socket paths must stay short
    network = netns.TwoHosts() if netns.unavailable() is None else None
    # One cluster secret for every process, as the chart's Secret gives them: workers refuse internal calls without it.
    env = {**ray_env(temp_dir), "PDSERVE_CLUSTER_SECRET": secrets.token_hex(32)}
    redis_server = RedisServer(host=network.gateway if network else "127.0.0.1")
    nodes: list[RayNode] = []
    r: Rehearsal | None = None
    try:
        redis_server.start()
        nodes = _start_nodes(temp_dir, env, network)
        args = ["controller", "--model", "tiny-random", "--ray-address", nodes[0].address, "--redis", redis_server.url]
        args += ["--prefill", "1", "--decode", "1", "--ray-namespace", NAMESPACE]
        args += ["--role-resources", "--build-resources"]
        args += ["--transfer-port", str(free_port()), "--threads", "1", "--kv-cache-gb", "0.05"]
        if network:
            args += ["--bind-host", "0.0.0.0"]  # each worker advertises its node's POD_IP
        r = Rehearsal(temp_dir, redis_server, nodes, args, env, network)
        r.start_controller()
        r.start_router()
        yield r
    finally:
        for p in r.started if r else []:
            p.stop(signal.SIGKILL)
        for node in reversed(nodes):
            node.stop()
        redis_server.stop()
        if network:
            network.remove()
        remove_temp_dir(temp_dir)


async def serve_at(address: str, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for msg, _ in generate(address, request(request_id), timeout_s=60):
        tokens += msg.token_ids
    return tokens


def serve(r: Rehearsal, request_id: str) -> list[int]:
    return asyncio.run(serve_at(f"127.0.0.1:{r.router_port}", request_id))

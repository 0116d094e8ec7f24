"""A fleet caught mid-rollout of new weights: Redis, one Ray node, four worker actors (a prefill and a decode worker
of tiny-random, a prefill and a decode worker of other weights, made as the controller makes them) heartbeating
into Redis, and a separate `pdserve router`. The actors are made by a driver of their own (this module run as a
script), so the test process never joins Ray; they are detached, as a controller's are, and nothing supervises
them (no controller would leave a fleet mixed for long)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.cluster.local_process import PdserveProcess, free_port

NAMESPACE = "pdserve-mixed"
# worker id -> which weights it runs: ids count across roles, as a controller's do.
OLD, NEW = "old", "new"
FLEET = {"prefill-0": OLD, "prefill-1": NEW, "decode-2": OLD, "decode-3": NEW}
# Each prefill worker re-checks its speed once idle this long, this often (cluster/speed_recheck.py): the defaults'
# 5 s and 30 s, shortened.
SPEED_RECHECK = {"speed_recheck_idle_s": 0.5, "speed_recheck_s": 1.0}


def write_new_weights(folder: Path) -> None:
    """tiny-random's shape and tokenizer with every weight moved by noise of another seed: other weights (another
    fingerprint) whose greedy answers differ from tiny-random's, as a fine-tune's would."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from pdserve.engine.models import resolve_model

    shutil.copytree(resolve_model("tiny-random"), folder)
    tensors = load_file(folder / "model.safetensors")
    noise = torch.Generator().manual_seed(1)
    moved = {name: t + 0.3 * t.std() * torch.randn(t.shape, generator=noise) for name, t in sorted(tensors.items())}
    save_file(moved, folder / "model.safetensors")


@dataclass
class MixedFleet:
    temp_dir: Path
    redis_url: str
    router_port: int = 0  # chosen once the Ray node and its actors hold the ports they take
    metrics_port: int = 0
    router: PdserveProcess | None = None

    @property
    def router_address(self) -> str:
        return f"127.0.0.1:{self.router_port}"

    @property
    def new_model(self) -> Path:
        return self.temp_dir / "new-weights"


def start_actors(ray_address: str, redis_url: str, new_model: Path, env: dict[str, str]) -> None:
    """Runs this module as Ray's driver: every actor made, each serving, before it returns."""
    args = [sys.executable, "-m", __name__, ray_address, redis_url, str(new_model)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the mixed fleet's driver failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


@contextmanager
def mixed_fleet_cluster(env: dict[str, str]) -> Iterator[MixedFleet]:
    """The cluster, all stopped after (the Ray node's session takes the actors with it)."""
    from tests.integration.ray_nodes import RayNode, ray_env, remove_temp_dir
    from tests.integration.rehearsal import started
    from tests.redis_server import RedisServer

    temp_dir = Path(tempfile.mkdtemp(prefix="pdmx", dir="/tmp"))  # short: Ray's socket paths must stay short
    env = {**env, **ray_env(temp_dir)}
    redis_server = RedisServer()
    node: RayNode | None = None
    fleet = MixedFleet(temp_dir, "")
    try:
        redis_server.start()
        fleet.redis_url = redis_server.url
        write_new_weights(fleet.new_model)
        node = started(lambda: RayNode(temp_dir, {}, env=env))
        start_actors(node.address, redis_server.url, fleet.new_model, env)
        fleet.router_port, fleet.metrics_port = free_port(), free_port()
        args = ["router", "--model", "tiny-random", "--redis", redis_server.url, "--port", str(fleet.router_port)]
        args += ["--metrics-port", str(fleet.metrics_port)]
        fleet.router = PdserveProcess(*args, log_path=temp_dir / "router.log", env=env)
        fleet.router.wait_ready()
        yield fleet
    finally:
        if fleet.router is not None:
            fleet.router.stop()
        if node is not None:
            node.stop()
        redis_server.stop()
        remove_temp_dir(temp_dir)


def _drive(ray_address: str, redis_url: str, new_model: str) -> None:
    import ray

    from pdserve.cluster.actors import WorkerActors
    from pdserve.cluster.worker_spec import WorkerSpec
    from pdserve.config import ClusterConfig, EngineConfig
    from pdserve.protocol.roles import Role
    from services.workers import add_worker_services

    models = {OLD: "tiny-random", NEW: new_model}
    config = ClusterConfig(ray_address=ray_address, ray_namespace=NAMESPACE, redis_url=redis_url)
    actors = WorkerActors(config, add_worker_services)
    actors.connect()
    made = []
    for worker_id, version in FLEET.items():
        engine = EngineConfig(model=models[version], dtype="float32", num_threads=1, kv_cache_memory_gb=0.05)
        role = Role(worker_id.rpartition("-")[0])
        spec = WorkerSpec(role, engine, worker_id=worker_id, registry_url=redis_url, exit_on_fatal=True)
        made.append(actors.get_or_create(replace(spec, **SPEED_RECHECK))[0])
    print("serving at", ray.get([actor.address.remote(300.0) for actor in made]), flush=True)


if __name__ == "__main__":
    _drive(*sys.argv[1:4])

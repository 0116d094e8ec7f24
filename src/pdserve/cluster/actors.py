"""The worker actors in Ray: one named actor per worker id in the cluster's Ray namespace, found again by name.

Joined to a Ray cluster (`--ray-address`), actors are detached: they outlive the process that made them, so a
controller or router restart (a Kubernetes Deployment's pod replaced) finds the same workers serving instead of
starting a second fleet. A local Ray started by `pdserve up` ends with it, a SIGKILLed one too (`ray_reaper.py`),
and its actors are its own.
With role resources each actor asks for the Ray custom resource of its role (`pdserve_prefill`, `pdserve_decode`,
`pdserve_colocated`), so a Ray node (a KubeRay worker group) started with that resource hosts that role only.
With build resources each also asks for its build's resource, so a rollout to a new image starts its workers on
nodes (pods) of that image, which Ray's autoscaler adds, never on the old image's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from typing import Any

from pdserve import env
from pdserve.addresses import split_host_port
from pdserve.build import build_resource
from pdserve.cluster.factories import WorkerServices
from pdserve.cluster.ray_join_check import check_join
from pdserve.cluster.ray_reaper import RayReaper
from pdserve.cluster.worker_runtime import WorkerRuntime
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import ClusterConfig
from pdserve.protocol.roles import Role

log = logging.getLogger(__name__)
LISTENING_TIMEOUT_S = 5.0  # a Ray address that neither accepts nor refuses by then: unreachable
NAME_RELEASE_TRIES = 20  # a dead actor's name is free once its handles are gone: well within 5 s
# A worker's share of its build's resource: a label, not a limit (role resources limit workers per node).
BUILD_RESOURCE_SHARE = 0.001
WORKER_ID = re.compile(rf"({'|'.join(r.value for r in Role)})-(\d+)")  # the fleet's ids: `role-i`


def role_resource(role: Role) -> str:
    """The Ray custom resource a worker of `role` asks for with role resources: one per worker on its node."""
    return f"pdserve_{role}"


def _log_ray_auth() -> None:
    """Says whether Ray's token authentication guards this cluster: whoever reaches Ray's ports without the token
    could otherwise run code in the workers, cluster secret included (the threat model relies on it)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled  # no public API yet
    except ImportError:
        log.warning("Ray token authentication: unknown (this Ray cannot say)")
        return
    if is_token_auth_enabled():
        log.info("Ray token authentication: on")
    else:
        log.warning("Ray token authentication: OFF (RAY_AUTH_MODE=%s)", env.ray_auth_mode() or "unset")


def _check_listening(address: str) -> None:
    """ConnectionError when nothing accepts connections at a joined Ray's address: ray.init would wait on it for
    ever on a thread no signal reaches (measured: 11 minutes through a SIGTERM and a SIGINT). A port that accepts
    is Ray's to judge; "auto" and other forms are passed on as they are."""
    try:
        dialed = split_host_port(address.removeprefix("ray://"))
    except ValueError:
        return
    try:
        socket.create_connection(dialed, timeout=LISTENING_TIMEOUT_S).close()
    except OSError as e:
        raise ConnectionError(f"nothing accepts connections at the Ray address {address} ({e})") from None


def _local_ray_failed(e: Exception) -> ChildProcessError:
    """What a start of our own Ray that failed says (Ray's own `Exception: The current node timed out during startup`
    on a loaded machine, where its processes took more than the 30 s it waits), with where Ray's logs are."""
    logs = env.ray_logs_dir()
    return ChildProcessError(f"the local Ray did not start: {e} (its logs: {logs}; on a loaded machine, try again)")


def _join_failed(address: str | None, e: Exception, called: str) -> ConnectionError:
    """A --ray-address Ray would not take (`Invalid address format: x`, an auth token it refuses), on one line: Ray's
    version mismatch names the versions on lines of their own, which a retry's log line (the first) left out.
    `called`: what `check_join`'s call got instead of an answer, where Ray Client says "connection timeout"."""
    reason = " ".join(str(e).split())
    return ConnectionError(
        f"could not join the Ray cluster at --ray-address {address}: {reason}"
        + (f"; called directly: {called}" if called else "")
    )


class _NotMainThreadWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("SIGTERM handler is not set")


class WorkerActors:
    """Connects to Ray (starting a local one unless joined) and finds or creates the worker actors."""

    def __init__(self, config: ClusterConfig, services: WorkerServices) -> None:
        self.config = config
        self.services = services
        self.detached = config.ray_address is not None
        self.started_ray = False
        self._reaper: RayReaper | None = None  # of the local Ray this process started
        self._gpus = 0

    def connect(self) -> None:
        env.pass_worker_logs_through()
        import ray

        c = self.config
        if not ray.is_initialized():
            if c.ray_address:
                _check_listening(c.ray_address)
            # Off the main thread Ray sets no SIGTERM handler and warns so; pdserve's own handler is the one wanted.
            logging.getLogger("ray._private.worker").addFilter(_NotMainThreadWarning())
            reaper = None if c.ray_address else RayReaper()  # a SIGKILL of this process leaves none of it running
            called = ""
            try:
                if c.ray_address:
                    called = check_join(c.ray_address)  # Ray Client tries a token it was refused for 30 s
                with reaper.marking() if reaper else contextlib.nullcontext():
                    ray.init(
                        # "local": a new Ray of our own, never one that RAY_ADDRESS or a `ray start` left running names.
                        address=c.ray_address or "local",
                        namespace=c.ray_namespace,
                        include_dashboard=False,
                        num_cpus=None if c.ray_address else os.cpu_count(),
                        object_store_memory=None if c.ray_address else 100 * 2**20,  # we pass no objects through it
                        runtime_env={"env_vars": env.worker_env()},
                        logging_level=logging.WARNING,
                        log_to_driver=True,
                    )
            except BaseException as e:
                if reaper:
                    reaper.close()  # what the failed start left
                if isinstance(e, Exception):  # Ray's own start or join failing is no bug of ours: no traceback
                    raise _local_ray_failed(e) if reaper else _join_failed(c.ray_address, e, called) from e
                raise
            if reaper:
                context = ray.get_runtime_context()
                reaper.watch_session(os.path.join(context.get_temp_dir(), context.get_session_name()))
            self.started_ray, self._reaper = c.ray_address is None, reaper
            _log_ray_auth()
        self._gpus = 1 if _wants_gpu(c.engine.device) else 0

    def get_or_create(self, spec: WorkerSpec) -> tuple[Any, bool]:
        """The actor named `spec.worker_id` in the namespace, and whether it existed already (it keeps the spec it
        was made with)."""
        import ray

        try:
            return ray.get_actor(spec.worker_id, namespace=self.config.ray_namespace), True
        except ValueError:  # no live actor of that name
            return self.create(spec), False

    def found_worker_ids(self) -> list[str]:
        """The ids of the live worker actors in the namespace, whatever their index or role: a scale or a rollout
        numbered them past the flags' ids, and a fleet of the other mode left its own roles' workers; a restarted
        controller must adopt them all, not only those, or they serve on unsupervised."""
        import ray

        names = ray.util.list_named_actors()  # the driver's namespace, the fleet's
        return sorted(n for n in names if WORKER_ID.fullmatch(n))

    def create(self, spec: WorkerSpec) -> Any:
        import ray

        actor_cls = ray.remote(WorkerRuntime).options(**self.actor_options(spec))
        for _ in range(NAME_RELEASE_TRIES):
            try:
                return actor_cls.remote(spec, self.services)
            except ValueError as e:  # the name is still held by a dead actor whose handles are being dropped
                log.info("worker %s: waiting for Ray to release its name: %s", spec.worker_id, e)
                time.sleep(0.25)
        return actor_cls.remote(spec, self.services)

    def actor_options(self, spec: WorkerSpec) -> dict[str, Any]:
        """Ray's options for the actor of `spec`: its name, lifetime, restarts and the resources that place it."""
        options: dict[str, Any] = {
            "name": spec.worker_id,
            "namespace": self.config.ray_namespace,
            "num_cpus": 0,
            "num_gpus": self._gpus,
            "max_restarts": self.config.max_restarts,
            "max_task_retries": 0,
        }
        if self.detached:
            options["lifetime"] = "detached"
        resources: dict[str, float] = {}
        if self.config.role_resources:
            resources[role_resource(spec.role)] = 1
        if self.config.build_resources:
            resources[build_resource(spec.build)] = BUILD_RESOURCE_SHARE
        if resources:
            options["resources"] = resources
        return options

    def kill(self, actor: Any) -> None:
        import ray

        ray.kill(actor, no_restart=True)

    def disconnect(self) -> None:
        import ray
        import ray.util.client

        if ray.is_initialized():
            ray.shutdown()
        elif ray.util.client.num_connected_contexts():  # a Ray Client that lost its connection: it stays registered
            ray.util.client.ray.disconnect()  # and would refuse the next connect
        if self._reaper:  # what the shutdown left (nothing, normally)
            self._reaper.close()
            self._reaper = None

    @staticmethod
    def connected() -> bool:
        """False once this process's connection to Ray is gone: a Ray Client (`ray://`) whose head went away gives
        up after its reconnect grace (RAY_CLIENT_RECONNECT_GRACE_PERIOD, 30 s by default) and never comes back."""
        import ray

        return ray.is_initialized()

    async def until_disconnected(self, poll_s: float = 1.0) -> None:
        while self.connected():
            await asyncio.sleep(poll_s)


def _wants_gpu(device: str) -> bool:
    """Whether a worker gets a GPU, decided from Ray's view of the cluster rather than torch's, so that the
    controller (the router's process under `pdserve up`) never imports torch: "auto" means CUDA wherever Ray
    found GPUs."""
    import ray

    if device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return device.startswith("cuda")


def actor_error_reason(e: BaseException) -> str:
    """An actor's own exception without Ray's traceback around it: its first line, for a log line or an error."""
    cause: BaseException = getattr(e, "cause", None) or e
    return (str(cause).strip() or repr(cause)).splitlines()[0][:500]

"""What one worker is asked to be: its role, its engine, where it serves and reports."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.config import ClusterConfig, EngineConfig, RouterConfig, SchedulerConfig
from pdserve.cpus import usable_cpus
from pdserve.protocol.roles import Role


@dataclass(frozen=True)
class WorkerSpec:
    role: Role
    engine: EngineConfig
    host: str = ClusterConfig.host  # where its listeners bind (a wildcard allowed)
    port: int = 0  # its gRPC port (0: a free one)
    worker_id: str = ""
    registry_url: str | None = None  # redis://...: heartbeat there; None: the launcher publishes for us
    heartbeat_s: float = RouterConfig.heartbeat_s
    metrics_port: int | None = 0  # Prometheus /metrics on this port (0: a free one, registered); None: none
    log_level: str | None = None  # set: this process logs structured lines at that level
    # Decode side: a KV transfer not done by then fails, freeing its blocks.
    kv_transfer_timeout_s: float = ClusterConfig.kv_transfer_timeout_s
    # A Ray actor: a failed start or a dead engine exits the process, so Ray restarts it; SIGTERM drains it. False
    # in tests that run a worker inside their own process.
    exit_on_fatal: bool = False
    drain_timeout_s: float = ClusterConfig.worker_drain_timeout_s  # SIGTERM's drain, and a drain asking for 0
    # Idle this long, and its speed read this long ago (0: never): a worker that takes prompts probes it
    # (cluster/speed_recheck.py).
    speed_recheck_idle_s: float = ClusterConfig.speed_recheck_idle_s
    speed_recheck_s: float = ClusterConfig.speed_recheck_s
    # The host its addresses name (gRPC, metrics, KV rendezvous): "" until the worker resolves it in its own
    # process (`pdserve.addresses.advertised_host`: the flag, its node's POD_IP, or the bind host).
    advertise_host: str = ""
    transfer_port: int = 0  # decode side: the first port of its KV rendezvous stores (0: free ones)
    build: str = ""  # its fleet's build (`pdserve.build`): a controller of a new build rolls the workers it adopts

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # a role's string is accepted, and checked here

    def engine_config(self) -> EngineConfig:
        """The engine its role runs, as built in the worker's own process (its thread count is that host's CPUs)."""
        scheduler = role_scheduler(self.engine.scheduler, self.role)
        config = replace(self.engine, scheduler=scheduler, num_threads=self.engine.num_threads or usable_cpus())
        if self.role is Role.DECODE:
            # Every prompt block arrives from a prefill worker, so nothing a decode worker caches is ever
            # matched; uncached freed blocks stay free, and reservations stay whole runs (copy-free transfers).
            config = replace(config, enable_prefix_caching=False)
        return config


def role_scheduler(scheduler: SchedulerConfig, role: Role) -> SchedulerConfig:
    """The batching a worker of `role` runs from the configured limits: the planner's simulator steps its workers
    by it too (planner/prefill_steps.py)."""
    scheduler = replace(scheduler, mode=role.engine_mode)
    if role is Role.PREFILL:
        # One prompt (or one chunk of a long one) per step: batching later prompts into an earlier one's step
        # delays its first token past what admission promised it. A prompt that fits one step goes ahead of a
        # longer one's remaining chunks (engine/short_first.py), as the routers price it.
        scheduler = replace(
            scheduler,
            max_num_batched_tokens=scheduler.long_prefill_chunk,
            max_prefills_per_step=1,
            short_prompts_first=True,
        )
    else:
        # A step takes its running sequences in order while its token budget lasts: past the budget, a full
        # batch's last sequences got no token, silent, until those ahead ended (a router takes such a silence
        # for a hung worker). Every sequence decodes each step, with a recompute's chunk beside them.
        whole_batch = scheduler.max_num_seqs + scheduler.long_prefill_chunk
        scheduler = replace(scheduler, max_num_batched_tokens=max(scheduler.max_num_batched_tokens, whole_batch))
    return scheduler

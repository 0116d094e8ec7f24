"""Configuration, one frozen dataclass per concern: built once at the edge (CLI, worker start-up), passed down,
never mutated. Each default is written here once; the CLI takes its defaults from these classes.

Torch-free: the router, the registry and the CLI import this module; torch specifics (which device, which
dtype object) are resolved in the engine (`pdserve.engine.device`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.protocol.outputs import PREEMPTED_NOTICE_S
from pdserve.protocol.request_checks import RequestLimits
from pdserve.protocol.roles import EngineMode, Role
from pdserve.redaction import redacted_url
from pdserve.security.cors_origins import check_cors_origins

# The largest gRPC message any server sends, and takes but for the router's public port (its requests are smaller)
MAX_MESSAGE_BYTES = 16 * 2**20
DTYPE_NAMES = ("float32", "bfloat16", "float16")
CLUSTER_MODES = ("disaggregated", "colocated")
# Workers of one role, also `pdserve scale`'s bound: one host's take this many consecutive ports (addresses.PORT_SPAN)
MAX_WORKERS_PER_ROLE = 64
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")  # what redis-py's from_url takes
DECODE_GRAPH_MODES = ("auto", "static", "off")
MAX_KV_CACHE_GB = 1e6  # a PiB, past any host or device (1e303 overflowed the block count: OverflowError tracebacks)
MAX_TORCH_THREADS = 1024  # past any host's cores, far below where threads fail to start (100000: a segfault)


class ConfigError(ValueError):
    """A setting out of its range, said naming its field (`setting`). A command names the flag that set it instead
    (`flags.flags_named`), a config file its key."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting} {problem}")
        self.setting, self.problem = setting, problem


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits of one engine step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_chunk: int = 512  # no single prefill takes more of a step than this
    max_prefills_per_step: int | None = None  # prompts a step may run; None: as many as the budget holds
    # A prompt that fits one step runs ahead of a longer prompt's next chunk (engine/short_first.py): prefill workers.
    short_prompts_first: bool = False
    mode: EngineMode = EngineMode.MIXED

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", f"must be at least 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class EngineConfig:
    """One engine: which model, in which precision on which device, its KV cache and its batching."""

    model: str = "smollm2-135m"  # a built-in name (model_files.BUILTIN_MODELS), a model folder or a .gguf
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: as many as kv_cache_memory_gb holds
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # CPU threads for torch; None: torch's default (a worker: the CPUs it may use)
    # Decode steps of up to max_num_seqs sequences at fixed batch sizes (engine.decode_graphs). auto: captured
    # in CUDA graphs on CUDA, off elsewhere; static: the same fixed-shape steps, not captured; off: eager.
    decode_graphs: str = "auto"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in (*DTYPE_NAMES, "auto"):
            raise ConfigError("dtype", f"must be one of {[*DTYPE_NAMES, 'auto']}, got {self.dtype!r}")
        if self.decode_graphs not in DECODE_GRAPH_MODES:
            raise ConfigError("decode_graphs", f"must be one of {list(DECODE_GRAPH_MODES)}, got {self.decode_graphs!r}")
        if not 0 < self.kv_cache_memory_gb < math.inf:  # nan too: a KV cache of no size, or of every byte
            raise ConfigError("kv_cache_memory_gb", f"must be a positive number, got {self.kv_cache_memory_gb}")
        if (gb := self.kv_cache_memory_gb) > MAX_KV_CACHE_GB:
            raise ConfigError("kv_cache_memory_gb", f"must be at most {MAX_KV_CACHE_GB:g} GiB, got {gb:g}")
        if (threads := self.num_threads) is not None and not 1 <= threads <= MAX_TORCH_THREADS:
            bound = "at least 1" if threads < 1 else f"at most {MAX_TORCH_THREADS}"
            raise ConfigError("num_threads", f"must be {bound}, got {threads}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError("device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    @property
    def mode(self) -> EngineMode:
        return self.scheduler.mode


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests and chaos runs (see `env.fault_config`); the default injects nothing."""

    kv_send_delay_s: float = 0.0  # a prefill worker stalls this long between the first token and the KV send
    request_id_prefix: str = ""  # only requests whose id starts with this are faulted ("": every request)
    engine_die_prefix: str = ""  # a worker's engine thread dies stepping a request whose id starts with this
    slow_step_prefix: str = ""  # a worker's engine step that runs a request whose id starts with this...
    slow_step_s: float = 0.0  # ...takes this much longer
    first_start_fails_dir: str = ""  # set: a worker's start fails unless this folder holds a file named after it
    slow_profile_worker_id: str = ""  # this worker's start-up profile prices every step...
    slow_profile_times: float = 1.0  # ...this many times what it measured (a profile timed on a loaded host)

    def __post_init__(self) -> None:
        for name in ("kv_send_delay_s", "slow_step_s"):  # a sleep of a negative time raises in the engine's step
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(name, f"must be a finite number of seconds >= 0, got {getattr(self, name)}")
        if not 0 < self.slow_profile_times < math.inf:
            raise ConfigError("slow_profile_times", f"must be a finite number > 0, got {self.slow_profile_times}")

    def kv_send_delay_for(self, request_id: str) -> float:
        return self.kv_send_delay_s if request_id.startswith(self.request_id_prefix) else 0.0

    def engine_dies_for(self, request_id: str) -> bool:
        return bool(self.engine_die_prefix) and request_id.startswith(self.engine_die_prefix)

    def step_delay_for(self, request_id: str) -> float:
        return self.slow_step_s if self.slow_step_prefix and request_id.startswith(self.slow_step_prefix) else 0.0

    def profile_times_for(self, worker_id: str) -> float:
        return self.slow_profile_times if worker_id == self.slow_profile_worker_id else 1.0


@dataclass(frozen=True)
class SLOClass:
    """Default SLO for requests of at least this priority that name none themselves."""

    priority: int
    ttft_ms: float
    tpot_ms: float


MAX_CONNECTION_AGE_S = 2_147_483  # gRPC's max_connection_age_ms is a C int: about 24.8 days
STALL_TIMEOUT_MIN_S = 2 * PREEMPTED_NOTICE_S  # a notice a second late still keeps a preempted stream in place


@dataclass(frozen=True)
class RouterConfig:
    default_ttft_ms: float = 5000.0
    default_tpot_ms: float = 500.0
    slo_classes: tuple[SLOClass, ...] = ()
    default_max_tokens: int = 256
    max_in_flight: int = 1024  # requests streaming through this router
    max_queued_prefill_tokens: int = 32768  # per prefill worker, predicted
    low_priority_reserve: float = 0.2  # share of room priority 0 leaves to > 0 (queue bound; batch, KV once > 0 asks)
    fair_share_reserve: float = 0.05  # share of batch places, KV, queue a tenant over its share leaves (admission.py)
    policy: str = "slo"  # "slo" (predicted TTFT/TPOT, prefix-aware) or "round-robin"
    transfer_gbps: float = 1.0  # KV transfer speed assumed in TTFT predictions
    slo_headroom: float = 0.8  # share of (SLO - own cost) that the predicted queueing may fill
    kv_claims: bool = True  # refused for KV room past its TTFT SLO, a request claims the blocks (kv_claims.py)
    heartbeat_s: float = 0.5
    registry_max_view_age_s: float = 0.0  # Redis unreachable this long: drop its workers; 0: serve the last view on
    prefix_match_budget_s: float = 0.03  # a prefix index slower than this: place as if no prefix were cached
    quota_budget_s: float = 0.05  # shared API-key quotas slower than this: this router's own limits answer
    request_limits: RequestLimits = RequestLimits()  # [router.request_limits] in a TOML file
    # The OpenAI HTTP API's largest request body (413 past it), read and parsed on the loop that relays every stream;
    # 0: what a valid request can hold at the model's context (services/router/request_size.py, 1 to 16 MiB).
    max_http_body_bytes: int = 0
    first_token_timeout_s: float = 60.0  # no first token by then (and no shorter client deadline): UNAVAILABLE
    stall_timeout_s: float = 5.0  # no message this long after the first: the stream is broken, and migrated
    # A caller that takes none of its stream this long (its window full, not reading, not gone) is taken as gone:
    # its request ends, cancelled, and its HTTP connection (a gRPC stream: CANCELLED) with it.
    reader_stall_timeout_s: float = 60.0
    sse_keepalive_s: float = 15.0  # an SSE stream silent this long (its first event's wait too) sends a comment
    max_attempts: int = 3  # placements a request may get before its first token (1: never retried)
    migration_limit: int = 3  # moves of a stream to another decode worker after tokens were sent (0: none)
    ejection_s: float = 10.0  # a worker whose call failed stays out of placement this long (or until restarted)
    # A role with no live worker at all: wait this long for one (a drained worker's replacement, a slow worker
    # re-listed) before answering UNAVAILABLE. Also how long a stream moving after tokens were sent waits, once,
    # for a decode worker with room for it.
    no_workers_wait_s: float = 3.0
    # A client's connection to this router gets a GOAWAY after this long (0: never), so clients behind one
    # Service spread over the router replicas added since they connected; streams open then run to their end.
    # An HTTP API connection is closed after its first response past it (`Connection: close`).
    max_connection_age_s: float = 300.0
    reflection: bool = True  # gRPC server reflection on the public port (--no-reflection: off)
    # One INFO line per request as it ends (~250 B: at 1000 req/s, ~24 GB a day); --no-access-log: none, while the
    # metrics still count every request and a failure still logs its warning.
    access_log: bool = True
    # The HTTP body's `safety_identifier` or `user` on its request's span as `enduser.id`: an end user's id, which
    # OpenTelemetry's registry marks as personal data (PII), for a tracing backend that may hold it; off, it is read
    # and dropped.
    trace_enduser_id: bool = False
    # Web origins whose pages a browser lets call the HTTP API (CORS; `*`: any); none: no CORS headers at all.
    http_cors_origins: tuple[str, ...] = ()
    http_cors_allow_credentials: bool = False  # those pages may send cookies and client certificates too
    api_keys_file: str | None = None  # TOML of API keys (--api-keys); None: an open cluster, said at start
    tls_cert: str | None = None  # PEM files: TLS on the public port (--tls-cert/--tls-key); None: plaintext
    tls_key: str | None = None
    tls_client_ca: str | None = None  # clients must present a certificate signed by this CA (mTLS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "http_cors_origins", tuple(self.http_cors_origins))  # a flag's or a file's list
        if self.http_cors_allow_credentials and not self.http_cors_origins:
            raise ConfigError("http_cors_allow_credentials", "needs the origins that may send them (http_cors_origins)")
        try:
            check_cors_origins(self.http_cors_origins, self.http_cors_allow_credentials)
        except ValueError as e:
            raise ConfigError("http_cors_origins", str(e)) from None
        if self.policy not in ("slo", "round-robin"):
            raise ConfigError("policy", f"must be 'slo' or 'round-robin', got {self.policy!r}")
        for name, zero in (("registry_max_view_age_s", "0 or "), ("prefix_match_budget_s", ""), ("quota_budget_s", "")):
            value = getattr(self, name)  # 0: a view kept however old; a budget of 0 would never use the index or quotas
            if not (value > 0 or (zero and value == 0)):
                raise ConfigError(name, f"must be {zero}positive, got {value!r}")
        if not 0 < self.transfer_gbps < float("inf"):  # a KV transfer's predicted time divides by it
            raise ConfigError("transfer_gbps", f"must be a positive number, got {self.transfer_gbps!r}")
        if self.migration_limit < 0:
            raise ConfigError("migration_limit", f"must not be negative, got {self.migration_limit}")
        if self.max_attempts < 1:
            raise ConfigError("max_attempts", f"must be at least 1, got {self.max_attempts}")
        if self.max_http_body_bytes < 0:
            raise ConfigError("max_http_body_bytes", f"must be >= 0 (0: derived), got {self.max_http_body_bytes}")
        positive = ("first_token_timeout_s", "stall_timeout_s", "reader_stall_timeout_s", "default_ttft_ms")
        for name in (*positive, "default_tpot_ms", "heartbeat_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(name, f"must be a positive number, got {getattr(self, name)}")
        if not 0.1 <= self.sse_keepalive_s < float("inf"):  # a comment every millisecond would keep the loop busy
            raise ConfigError("sse_keepalive_s", f"must be at least 0.1 s, got {self.sse_keepalive_s}")
        if self.stall_timeout_s < STALL_TIMEOUT_MIN_S:  # a preempted stream, silent but for its notices, would move
            raise ConfigError(
                "stall_timeout_s",
                f"must be at least {STALL_TIMEOUT_MIN_S:g} s (twice the {PREEMPTED_NOTICE_S:g} s "
                f"between a decode worker's notices that a stream it preempted waits), got {self.stall_timeout_s}",
            )
        for name in ("max_in_flight", "max_queued_prefill_tokens", "default_max_tokens"):
            if getattr(self, name) < 1:  # a bound of none would shed (or refuse) every request
                raise ConfigError(name, f"must be at least 1, got {getattr(self, name)}")
        if not (self.max_connection_age_s == 0 or 0.001 <= self.max_connection_age_s <= MAX_CONNECTION_AGE_S):
            raise ConfigError(  # gRPC takes whole milliseconds in a C int
                "max_connection_age_s",
                f"must be 0 (never) or lie in [0.001, {MAX_CONNECTION_AGE_S}], got {self.max_connection_age_s!r}",
            )
        for name in ("ejection_s", "no_workers_wait_s"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ConfigError(name, f"must not be negative, got {getattr(self, name)}")
        for name in ("low_priority_reserve", "fair_share_reserve"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(name, f"must lie in [0, 1], got {getattr(self, name)}")
        if not 0 < self.slo_headroom <= 1:
            raise ConfigError("slo_headroom", f"must lie in (0, 1], got {self.slo_headroom}")
        for c in self.slo_classes:
            if not (0 < c.ttft_ms < float("inf") and 0 < c.tpot_ms < float("inf")):
                raise ValueError(f"slo_classes: priority {c.priority}'s ttft_ms and tpot_ms must be positive, got {c}")

    def slo_for(self, priority: int, ttft_ms: float, tpot_ms: float) -> tuple[float, float]:
        """The request's own SLO where it set one (non-zero), else its priority class's, else the default."""
        default_ttft, default_tpot = self.default_ttft_ms, self.default_tpot_ms
        for c in sorted(self.slo_classes, key=lambda c: c.priority):
            if priority >= c.priority:
                default_ttft, default_tpot = c.ttft_ms, c.tpot_ms
        return ttft_ms or default_ttft, tpot_ms or default_tpot

    def queue_bound(self, priority: int) -> float:
        """Higher priority gets in first when capacity is short: lower ones see a smaller queue bound."""
        return self.max_queued_prefill_tokens * (1 - self.priority_reserve(priority))

    def priority_reserve(self, priority: int) -> float:
        """The share of the room a request leaves to priorities above its own: none above 0, twice 0's below it."""
        return 0.0 if priority > 0 else min(self.low_priority_reserve * (1 if priority == 0 else 2), 1.0)

    @classmethod
    def from_file(cls, path: str, **overrides: Any) -> RouterConfig:
        """A TOML file's [router] table (config_file.py), then explicit overrides. ValueError naming the file and the
        key for a misspelled key or [router], a setting outside any table, a value of the wrong type or out of its
        range: none is dropped or taken silently."""
        from pdserve.config_file import read_router_config

        return replace(read_router_config(path, cls), **{k: v for k, v in overrides.items() if v is not None})


MAX_KV_TRANSFER_TIMEOUT_S = 86_400.0  # the KV transfer header's bound (transfer/wire.py MAX_TIMEOUT_MS)


@dataclass(frozen=True)
class ClusterConfig:
    """What `pdserve up`, `pdserve controller` and `pdserve router` run: the cluster's shape, where it listens,
    and each part's own config."""

    engine: EngineConfig = EngineConfig()
    mode: str = "disaggregated"  # one of CLUSTER_MODES
    prefill: int = 1  # workers per role when disaggregated
    decode: int = 1
    workers: int = 2  # workers doing both phases when colocated
    host: str = "127.0.0.1"  # address the router and the workers bind (--bind-host; `up` also takes --host)
    advertise_host: str | None = None  # what addresses name; None: POD_IP, else the bind host unless a wildcard
    port: int = 50051  # the router's public gRPC port
    worker_port: int = 0  # a worker's gRPC port, the next ones for more workers on a host (0: free ports)
    transfer_port: int = 0  # a decode worker's first KV rendezvous port, the next per prefill peer (0: free ports)
    worker_metrics_port: int = 0  # a worker's /metrics port, the next ones for more workers on a host (0: free)
    ray_address: str | None = None  # None: start a local Ray
    ray_namespace: str = "pdserve"  # the Ray namespace the worker actors are named in
    role_resources: bool = False  # each actor asks for Ray resource pdserve_<role>: one worker group per role
    # Each actor also asks for a sliver of its build's Ray resource (`pdserve.build.build_resource`), which only
    # nodes of that build advertise: a new image's workers start on new pods, never on an old image's.
    build_resources: bool = False
    stop_workers_on_exit: bool = True  # on SIGTERM; `pdserve controller` leaves them serving unless told to
    redis_url: str | None = None  # None: the embedded in-process registry
    router: RouterConfig = RouterConfig()
    max_restarts: int = 3  # per worker actor
    drain_grace_s: float = 20.0  # the router's drain on SIGTERM: how long in-flight requests may finish
    # A worker's drain (SIGTERM to it, or `pdserve drain` without --timeout): how long its in-flight requests may
    # finish before what is left moves to other workers.
    worker_drain_timeout_s: float = 30.0
    # A rollout surges a role's only worker (its successor serves before it drains) when a Ray node takes the
    # successor within this; else, or with 0, that worker restarts in place (the role empty while its model loads).
    rollout_surge_wait_s: float = 60.0
    metrics_port: int | None = None  # the router's Prometheus /metrics; None: not served
    http_port: int | None = None  # the router's OpenAI-compatible HTTP API; None (or --http-port 0): not served
    log_level: str = "INFO"
    # A KV transfer not started by then fails, freeing its blocks; one started gets as long again for its bytes.
    kv_transfer_timeout_s: float = 30.0
    # An idle worker that takes prompts times one of its own (cluster/speed_recheck.py) once nothing ran or was held
    # for `speed_recheck_idle_s` (a lull in traffic shorter than that, its live steps read) and its speed was last
    # read (a live step, a probe) `speed_recheck_s` ago (0: never): twice in the router's 60 s best-speed window, for
    # 0.8% of a core while idle on smollm2-135m, one thread (a probe: 0.22 s; a colocated worker's, its decodes too:
    # 0.36 s).
    speed_recheck_idle_s: float = 5.0
    speed_recheck_s: float = 30.0
    internal_tls_cert: str | None = None  # PEM files: mTLS on every internal hop (all three, or none)
    internal_tls_key: str | None = None
    internal_tls_ca: str | None = None  # the cluster CA: internal peers must present a certificate it signed
    # The name every internal certificate carries, checked instead of the address dialled (a pod IP on Kubernetes).
    internal_tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in CLUSTER_MODES:
            raise ConfigError("mode", f"must be one of {CLUSTER_MODES}, got {self.mode!r}")
        colocated = self.mode == "colocated"
        counts = {"workers": self.workers} if colocated else {"prefill": self.prefill, "decode": self.decode}
        for name, n in counts.items():
            if not 1 <= n <= MAX_WORKERS_PER_ROLE:
                raise ConfigError(name, f"must be 1 to {MAX_WORKERS_PER_ROLE} workers in {self.mode} mode, got {n}")
        if self.max_restarts < 0:
            raise ConfigError(
                "max_restarts",
                f"must be >= 0 (Ray's restarts of a worker before it is replaced), got {self.max_restarts}",
            )
        given = [self.internal_tls_cert, self.internal_tls_key, self.internal_tls_ca]
        if any(given) and not all(given):
            raise ValueError("give all of --internal-tls-cert, --internal-tls-key and --internal-tls-ca, or none")
        if self.internal_tls_server_name and not any(given):
            raise ValueError(
                "--internal-tls-server-name needs --internal-tls-cert, --internal-tls-key, --internal-tls-ca"
            )
        if self.router.http_cors_origins and self.http_port is None:
            raise ValueError("--http-cors-origins needs --http-port: it is the HTTP API's")
        for name in ("port", "worker_port", "transfer_port", "worker_metrics_port", "metrics_port", "http_port"):
            if (port := getattr(self, name)) is not None and not 0 <= port < 65536:
                raise ConfigError(name, f"must be a TCP port (0: any free one), got {port}")
        if self.redis_url is not None and not self.redis_url.startswith(REDIS_SCHEMES):
            raise ConfigError(
                "redis_url", f"must be a redis://, rediss:// or unix:// URL, got {redacted_url(self.redis_url)!r}"
            )
        if self.advertise_host in ("0.0.0.0", "::"):
            raise ConfigError("advertise_host", f"must be an address others can dial, got {self.advertise_host!r}")
        if not 0 <= self.drain_grace_s < math.inf:
            raise ConfigError(
                "drain_grace_s", f"must be a finite number >= 0 (0: stop at once), got {self.drain_grace_s}"
            )
        if not 0 <= self.worker_drain_timeout_s < math.inf:
            raise ConfigError(
                "worker_drain_timeout_s",
                f"must be a finite number >= 0 (0: cut at once), got {self.worker_drain_timeout_s}",
            )
        if not 0 < self.speed_recheck_idle_s < math.inf:
            raise ConfigError("speed_recheck_idle_s", f"must be a positive number, got {self.speed_recheck_idle_s}")
        if not 0 <= self.speed_recheck_s < math.inf:
            raise ConfigError("speed_recheck_s", f"must be >= 0 (0: never), got {self.speed_recheck_s}")
        if not 0 <= self.rollout_surge_wait_s < math.inf:
            raise ConfigError("rollout_surge_wait_s", f"must be >= 0 (0: never surge), got {self.rollout_surge_wait_s}")
        if not 0 < self.kv_transfer_timeout_s <= MAX_KV_TRANSFER_TIMEOUT_S:
            raise ConfigError(
                "kv_transfer_timeout_s",
                f"must be above 0 and at most {MAX_KV_TRANSFER_TIMEOUT_S:g} (a day, the KV "
                f"transfer header's bound), got {self.kv_transfer_timeout_s}",
            )

    @property
    def roles(self) -> list[Role]:
        if self.mode == "colocated":
            return [Role.COLOCATED] * self.workers
        return [Role.PREFILL] * self.prefill + [Role.DECODE] * self.decode

    def worker_engine(self) -> EngineConfig:
        return replace(self.engine, num_threads=self.threads_per_worker())

    def threads_per_worker(self) -> int | None:
        """The engine config's count, else a fair share of this machine's cores among the workers it hosts. With
        role resources each worker has a node (a pod) of its own: None, so it takes the CPUs it may use there."""
        if self.engine.num_threads or self.role_resources:
            return self.engine.num_threads
        return max(1, (os.cpu_count() or 1) // len(self.roles))

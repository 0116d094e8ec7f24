"""The worker registry: who serves, where, and how loaded; plus the index of cached prompt prefixes."""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields

from pdserve.config import EngineConfig
from pdserve.protocol.admitted import AdmittedTotals
from pdserve.protocol.compatibility import UNSAID_KV_WIRE_VERSION
from pdserve.protocol.perf_profile import PerfProfile, QueuedPrefill
from pdserve.protocol.roles import Role

DEFAULT_TTL_S = 5.0  # a worker silent this long is gone; heartbeats come every fraction of a second
PREFIX_TTL_S = 3600  # a worker's prefix-index entry nobody refreshed this long is dropped (a worker gone)
VIEW_REFRESH_S = 0.25  # how often a router re-reads a remote registry: a worker listed reaches it within this
RETIRED_KEEP_S = 3600.0  # how long a retired id is remembered: past any router's memory of a gone worker (5 min)


@dataclass(frozen=True)
class WorkerState:
    """One worker as routers see it; refreshed by heartbeat, gone when the heartbeat stops."""

    worker_id: str
    role: Role
    address: str  # host:port of its gRPC server
    model_fingerprint: str = ""
    block_size: int = EngineConfig.block_size
    kv_bytes_per_token: int = 0  # what moving one prompt token's KV costs
    kv_blocks_total: int = 0
    # Free now for a new request, prefix-cached blocks included (evicted on demand), less kv_blocks_owed.
    kv_blocks_free: int = 0
    queued_prefill_tokens: int = 0
    running: int = 0
    waiting: int = 0
    profile: PerfProfile | None = None
    speed_factor: float = 1.0  # measured / profiled step time, from live steps
    metrics_address: str = ""  # host:port serving this worker's Prometheus /metrics; "" when it serves none
    kv_blocks_cached: int = 0  # free blocks that still hold prefix-cached KV (kept until evicted)
    pid: int = 0  # the worker's process id on its host (what an operator or `pdserve chaos` signals); 0: unknown
    draining: bool = False  # leaving: no router places a request on it (its in-flight ones finish or move)
    build: str = ""  # the build its process runs (`pdserve.build`); "": a worker too old to say
    max_num_seqs: int = 0  # the most sequences its batch decodes (a decode worker refuses more); 0: unknown
    sequences: int = 0  # running, waiting, and (decode) those whose KV is arriving: what max_num_seqs bounds
    load_at: float = 0.0  # its wall time the load fields were sampled (before updated_at); 0: unknown, updated_at
    instance: str = ""  # a random id of its process, new on every start; "": a worker too old to say
    # The prompts of queued_prefill_tokens and their attention squares, summed (QueuedPrefill: a prompt's new tokens'
    # reads of its cached prefix too): a router prices the queue as each prompt alone. 0 prompts with tokens queued: a
    # worker too old to say.
    queued_prefill_prompts: int = 0
    queued_prefill_token_squares: int = 0
    # A prompt of at most short_prompt_tokens new tokens runs ahead of longer prompts' remaining chunks
    # (engine/short_first.py) and waits only for the short prompts waiting and the chunk in flight: the
    # queued_short_prefill_* part of the queue, and prefill_chunk_s, the seconds of a chunk in flight where an earlier
    # chunk of its prompt ran (as long as that took). 0: the worker takes prompts in order (or is too old to say).
    short_prompt_tokens: int = 0
    queued_short_prefill_prompts: int = 0
    queued_short_prefill_tokens: int = 0
    queued_short_prefill_token_squares: int = 0
    prefill_chunk_s: float = 0.0
    # The optional request features it honours, and its KV header's version (protocol/compatibility.py); (), 0: a
    # worker too old to say, which honours no feature added since and speaks UNSAID_KV_WIRE_VERSION.
    features: tuple[str, ...] = ()
    kv_wire_version: int = 0
    # Of the free blocks, those its own sequences will need (a decode worker's preempted and growing ones: its
    # reservations leave them), so not in kv_blocks_free; 0: none, or a worker too old to say.
    kv_blocks_owed: int = 0
    # How long before it was handed on (written to Redis, returned to the supervisor) its load was sampled, on its own
    # monotonic clock; -1: a worker too old to say (its load_at and updated_at say it on its wall clock).
    load_age_s: float = -1.0
    # How much the short prompts that go ahead of a long prompt's chunks stretched its recent long prompts' prefill
    # (engine/prefill_stretch.py): their wall time over their own chunks'. 1.0: none, or a worker too old to say.
    prefill_stretch: float = 1.0
    # Its vocabulary's digest (Tokenizer.digest): routers place only on workers of their own tokenizer's. "": a
    # worker too old to say, placed as before.
    tokenizer: str = ""
    # How many sequences its engine had freed when its load was sampled (Scheduler.num_freed): a stream whose end said
    # at most this many (x-pdserve-sequences-freed) was free in its kv_blocks_free already. 0: none, or a worker too
    # old to say.
    sequences_freed: int = 0
    # The TTL its Redis entry was written with (the entry's, not the worker's): less the key's PTTL, the entry's age.
    written_ttl_ms: int = field(default=0, compare=False)
    updated_at: float = field(default_factory=time.time)  # its wall clock: never compared with another host's
    # Not on the wire: when this process heard it, on this process's monotonic clock (a registry sets it as it takes
    # the state in: the supervisor's receipt, or the Redis entry's write, reckoned on Redis's clock).
    heard_at: float = field(default_factory=time.monotonic, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # from JSON or a caller's string: one type, checked
        object.__setattr__(self, "features", tuple(self.features))  # JSON's list

    @property
    def speaks_kv_wire_version(self) -> int:
        return self.kv_wire_version or UNSAID_KV_WIRE_VERSION

    @property
    def kv_pairing(self) -> tuple[str, int, int]:
        """What a prefill and a decode worker must share for one's KV to serve the other: the weights and block size
        (a prefill worker refuses a decode worker's others, services/prefill/run_and_send.py) and the KV header's
        version (a decode worker drops a pair speaking another). Routers pair workers only where it is equal."""
        return self.model_fingerprint, self.block_size, self.speaks_kv_wire_version

    @property
    def kv_blocks_used(self) -> int:
        """Blocks held by live sequences or transfers: neither free for a new request nor owed."""
        return self.kv_blocks_total - self.kv_blocks_free - self.kv_blocks_owed

    @property
    def queued_prefill(self) -> QueuedPrefill:
        return QueuedPrefill(self.queued_prefill_prompts, self.queued_prefill_tokens, self.queued_prefill_token_squares)

    def queued_prefill_ahead_of(self, new_tokens: int) -> QueuedPrefill:
        """The part of its queue a prompt of `new_tokens` to compute waits for."""
        if 0 < new_tokens <= self.short_prompt_tokens:
            return QueuedPrefill(
                self.queued_short_prefill_prompts,
                self.queued_short_prefill_tokens,
                self.queued_short_prefill_token_squares,
            )
        return self.queued_prefill

    @property
    def load_sampled_at(self) -> float:
        """When its load was sampled, on this process's monotonic clock: what a router's own placements are timed
        against, so no two hosts' clocks ever meet (hosts need no synchronized clocks for placement)."""
        if self.load_age_s >= 0:
            return self.heard_at - self.load_age_s
        # A worker too old to say: the age its two wall-clock stamps give, its clock read against itself.
        return self.heard_at - (max(0.0, self.updated_at - self.load_at) if self.load_at else 0.0)

    @property
    def cache_key(self) -> str:
        """Its process's prefix cache in a prefix index: a worker restarted under the same id (a drain's restart,
        a crash's replacement, a removed id handed out again) starts with an empty cache, which the index must
        not claim holds its predecessor's blocks (a container restarted in place may have the same address and
        pid: its instance differs)."""
        return f"{self.worker_id}/{self.instance or f'{self.address}/{self.pid}'}"

    def to_json(self) -> str:
        d = asdict(self)
        del d["heard_at"]  # this process's clock: meaningless on another host
        d["profile"] = self.profile.to_dict() if self.profile else None
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerState:
        d = json.loads(text)
        d["profile"] = PerfProfile.from_dict(d["profile"]) if d.get("profile") else None
        # A newer worker's extra fields: ignored while routers upgrade; `heard_at` is the reader's own to set.
        return cls(**{k: v for k, v in d.items() if k in _STATE_FIELDS})


# Read once: `fields` walks the class, and every router parses every worker's entry at each view refresh.
_STATE_FIELDS = frozenset(f.name for f in fields(WorkerState)) - {"heard_at"}


class Registry(ABC):
    ttl_s: float = DEFAULT_TTL_S
    refresh_s: float = 0.0  # how often `workers` is re-read from elsewhere: 0 where it is this process's own

    @abstractmethod
    def publish(self, state: WorkerState) -> None:
        """Called by a worker's heartbeat (or the launcher on its behalf): registers or refreshes it for
        `ttl_s`. A worker that stops publishing drops out of `workers` when the TTL runs out."""

    @abstractmethod
    def remove(self, worker_id: str, instance: str = "") -> None:
        """Called when a worker stops or is found dead; routers stop placing on it at once. `instance`: only while
        its entry is that process's (`WorkerState.instance`): one found dead late (a launcher resumed from a freeze)
        must not take out the process Ray restarted in its place meanwhile, which listed itself already."""

    @abstractmethod
    def retire(self, worker_id: str) -> None:
        """Called when a worker is removed for good (a scale-down): removed, and until its id registers again (an
        id handed out anew) routers know it will not come back, where one merely gone may be restarting."""

    @abstractmethod
    def retired(self) -> set[str]:
        """The ids retired lately and not registered since. No I/O, as `workers`."""

    @abstractmethod
    def workers(self, role: Role | None = None) -> list[WorkerState]:
        """Called by routers per request: the live workers, optionally of one role. Never does I/O and never
        raises for a lost backend: it answers from the last view it had, within that view's age limit."""

    def view_current(self) -> bool:
        """Whether `workers` reflects the backend now, not a last view kept (or dropped) through an outage: a
        worker missing from it is then really gone."""
        return True

    @abstractmethod
    def desired_counts(self) -> dict[Role, int]:
        """How many workers of each role the cluster should run ({} until the fleet or `pdserve scale` set them):
        where every router and the fleet agree on the cluster's shape. A remote registry blocks briefly and raises
        when it cannot answer; call it off the event loop."""

    @abstractmethod
    def set_desired_counts(self, counts: dict[Role, int], from_flags: bool = False) -> None:
        """Replaces the desired counts whole (the fleet starts or stops workers to match). `from_flags`: they are
        the fleet's own flags', also kept as `flag_counts`. Blocks and raises as `desired_counts`."""

    @abstractmethod
    def merge_desired_counts(self, counts: dict[Role, int]) -> bool:
        """Sets the desired counts of the roles in `counts` and leaves the others', in one step: two scales of
        different roles at once both hold. Only onto counts there: False, and nothing written, when there are none
        (a Redis restarted empty since they were read), where a merge would leave the other roles without one.
        Blocks and raises as `desired_counts`."""

    @abstractmethod
    def restore_desired_counts(self, counts: dict[Role, int], flag_counts: dict[Role, int]) -> None:
        """Sets the desired counts, and the flags' counts, each only where the registry has none (it restarted
        empty): counts set meanwhile stay. Blocks and raises as `desired_counts`."""

    @abstractmethod
    def flag_counts(self) -> dict[Role, int]:
        """The counts a fleet's flags last set: a fleet restarted with the same flags keeps what `pdserve scale`
        set since, one started with other flags (a new revision's) applies its own. Blocks and raises as
        `desired_counts`."""

    @abstractmethod
    def add_admitted(self, more: AdmittedTotals, writer: str, seq: int) -> None:
        """Adds a router's newly admitted requests to the cluster's totals (every router's), once: `writer` (the
        router's own id) numbers its adds, and an add numbered no higher than its last applied one is a retry,
        skipped. Blocks and raises as `desired_counts`."""

    @abstractmethod
    def admitted(self) -> AdmittedTotals:
        """What every router of the cluster admitted, cumulative. Blocks and raises as `desired_counts`."""

    async def start(self) -> None:  # noqa: B027 (a no-op unless the registry is remote)
        """Called once on the router's event loop before it serves: a remote registry starts keeping its
        view fresh in the background here, so that `workers` never waits on the network."""

    async def close(self) -> None:  # noqa: B027 (a no-op unless the registry is remote)
        """Called when the router stops: ends what `start` began."""


class PrefixIndex(ABC):
    """Which prompt-prefix blocks (by the engine's chained block hash) each prefill worker likely caches, by its
    process (`WorkerState.cache_key`)."""

    @abstractmethod
    def record(self, cache_key: str, block_hashes: list[bytes]) -> None:
        """Called by a router on its event loop after placing a prompt on a worker: that worker will cache
        these blocks. Never blocks the request: a remote index writes in the background, and a lost write
        costs a cache hit, never a request."""

    @abstractmethod
    async def match(self, cache_keys: list[str], block_hashes: list[bytes]) -> dict[str, int]:
        """For each worker, how many of the leading `block_hashes` it holds (a hit must start at block 0).
        A remote index answers within a short budget, or all zeros: placement without a prefix hit beats a
        request waiting on a slow index."""

    async def close(self) -> None:  # noqa: B027 (a no-op unless the registry is remote)
        """Called when the router stops: ends any background writes."""

"""Engine configuration: built once at the edge (CLI, worker start-up) and passed down, never mutated."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.scheduler import SchedulerConfig
from pdserve.protocol.roles import EngineMode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny-random"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: as many as kv_cache_memory_gb holds
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # CPU threads for torch; None leaves torch's default
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"dtype must be one of {[*DTYPES, 'auto']}, got {self.dtype!r}")

    @property
    def mode(self) -> EngineMode:
        return self.scheduler.mode

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests and chaos runs (see `env.fault_config`); the default injects nothing."""

    kv_send_delay_s: float = 0.0  # a prefill worker stalls this long between the first token and the KV send
    request_id_prefix: str = ""  # only requests whose id starts with this are faulted ("": every request)

    def kv_send_delay_for(self, request_id: str) -> float:
        return self.kv_send_delay_s if request_id.startswith(self.request_id_prefix) else 0.0


@dataclass(frozen=True)
class SLOClass:
    """Default SLO for requests of at least this priority that name none themselves."""

    priority: int
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True)
class RouterConfig:
    default_ttft_ms: float = 5000.0
    default_tpot_ms: float = 500.0
    slo_classes: tuple[SLOClass, ...] = ()
    default_max_tokens: int = 256
    max_in_flight: int = 1024  # requests streaming through this router
    max_queued_prefill_tokens: int = 32768  # per prefill worker, predicted
    low_priority_reserve: float = 0.2  # share of the queue bound only priority > 0 may fill
    policy: str = "slo"  # "slo" (predicted TTFT/TPOT, prefix-aware) or "round-robin"
    transfer_gbps: float = 1.0  # KV transfer speed assumed in TTFT predictions
    slo_headroom: float = 0.8  # share of (SLO - own cost) that the predicted queueing may fill
    heartbeat_s: float = 0.5
    first_token_timeout_s: float = 60.0  # no first token by then (and no shorter client deadline): UNAVAILABLE

    def __post_init__(self) -> None:
        if self.policy not in ("slo", "round-robin"):
            raise ValueError(f"policy must be 'slo' or 'round-robin', got {self.policy!r}")
        if not 0 < self.first_token_timeout_s < float("inf"):
            raise ValueError(f"first_token_timeout_s must be a positive number, got {self.first_token_timeout_s}")

    def slo_for(self, priority: int, ttft_ms: float, tpot_ms: float) -> tuple[float, float]:
        """The request's own SLO where it set one (non-zero), else its priority class's, else the default."""
        default_ttft, default_tpot = self.default_ttft_ms, self.default_tpot_ms
        for c in sorted(self.slo_classes, key=lambda c: c.priority):
            if priority >= c.priority:
                default_ttft, default_tpot = c.ttft_ms, c.tpot_ms
        return ttft_ms or default_ttft, tpot_ms or default_tpot

    def queue_bound(self, priority: int) -> float:
        """Higher priority gets in first when capacity is short: lower ones see a smaller queue bound."""
        if priority > 0:
            return self.max_queued_prefill_tokens
        share = 1 - self.low_priority_reserve * (1 if priority == 0 else 2)
        return self.max_queued_prefill_tokens * max(share, 0.0)

    @classmethod
    def from_file(cls, path: str, **overrides: object) -> RouterConfig:
        """A TOML file's [router] table (slo classes as [[router.slo_classes]]), then explicit overrides."""
        import tomllib

        with open(path, "rb") as f:
            table = dict(tomllib.load(f).get("router", {}))
        table["slo_classes"] = tuple(SLOClass(**c) for c in table.get("slo_classes", ()))
        table.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**table)

"""Engine configuration: built once at the edge (CLI, worker start-up) and passed down, never mutated."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.scheduler import EngineMode, SchedulerConfig

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

"""Where an engine runs and in which precision: the torch side of `EngineConfig`'s device and dtype names.

Kept out of `pdserve.config` so that the router, the registry and the CLI can read configuration without
importing torch.
"""

from __future__ import annotations

import torch

from pdserve.config import DTYPE_NAMES, EngineConfig

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_device(config: EngineConfig) -> torch.device:
    """ "auto" is CUDA when this process sees a GPU, else the CPU."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    """ "auto" is bfloat16 on CUDA and float32 on the CPU, where bfloat16 matmuls are slow."""
    if config.dtype == "auto":
        return torch.bfloat16 if resolve_device(config).type == "cuda" else torch.float32
    return DTYPES[config.dtype]


def synchronize(device: torch.device) -> None:
    """Waits for the work queued on `device` (CUDA runs asynchronously), so a timer around it times the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""Every PDSERVE_* environment variable is read here, once, and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models live: $PDSERVE_CACHE_DIR, default ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def worker_env() -> dict[str, str]:
    """The variables a launched worker process must see as the launcher does (model cache, telemetry)."""
    return {k: v for k, v in os.environ.items() if k.startswith(("PDSERVE_", "OTEL_"))}

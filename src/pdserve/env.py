"""Every PDSERVE_* environment variable is read here, once, and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.config import FaultConfig


def cache_dir() -> Path:
    """Where converted models live: $PDSERVE_CACHE_DIR, default ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def pod_ip() -> str | None:
    """POD_IP (Kubernetes' downward API): the address a process in a pod advertises unless told another."""
    return os.environ.get("POD_IP") or None


def worker_env() -> dict[str, str]:
    """The variables a launched worker process must see as the launcher does (model cache, telemetry)."""
    return {k: v for k, v in os.environ.items() if k.startswith(("PDSERVE_", "OTEL_"))}


def fault_config() -> FaultConfig:
    """Testing and chaos knobs, all off unless set; they let tests fail a real cluster at a chosen moment.

    PDSERVE_FAULT_KV_SEND_DELAY_S: a prefill worker sleeps this many seconds after streaming a request's first
      token and before sending its KV, so a test can outwait the decode side's transfer timeout or kill the
      worker mid-transfer without racing a sub-millisecond send.
    PDSERVE_FAULT_REQUEST_ID_PREFIX: only requests whose id starts with this are faulted (default: every one),
      so healthy requests can run beside faulted ones on the same cluster.
    PDSERVE_FAULT_ENGINE_DIE_REQUEST_ID_PREFIX: a worker's engine step raises (its engine thread dies, as on a
      real step failure) when it runs a request whose client request id starts with this; unset: never.
    PDSERVE_FAULT_FIRST_START_FAILS_DIR: each worker's first start fails (after it leaves a file named after it
      in this folder, so its restart by Ray succeeds); unset: never.
    """
    return FaultConfig(
        kv_send_delay_s=float(os.environ.get("PDSERVE_FAULT_KV_SEND_DELAY_S") or FaultConfig.kv_send_delay_s),
        request_id_prefix=os.environ.get("PDSERVE_FAULT_REQUEST_ID_PREFIX") or FaultConfig.request_id_prefix,
        engine_die_prefix=os.environ.get("PDSERVE_FAULT_ENGINE_DIE_REQUEST_ID_PREFIX") or FaultConfig.engine_die_prefix,
        first_start_fails_dir=os.environ.get("PDSERVE_FAULT_FIRST_START_FAILS_DIR") or "",
    )


def otel_traces_exporter() -> str | None:
    """Which span exporter the standard OTEL_* variables ask for: "otlp", "console", or None (export nothing).
    An OTLP endpoint alone means OTLP; OTEL_TRACES_EXPORTER=none turns exporting off."""
    named = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named == "none":
        return None
    if named in ("otlp", "console"):
        return named
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return "otlp"
    return None


def otel_traces_protocol() -> str:
    """grpc or http/protobuf (the OpenTelemetry default)."""
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()

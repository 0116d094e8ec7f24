"""This process's environment is read and written here and nowhere else (tests/unit/test_environment_access.py):
every PDSERVE_* variable, and the others pdserve reads (Kubernetes', Ray's, OpenTelemetry's)."""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pdserve.config import ConfigError, FaultConfig

BUILD_VAR = "PDSERVE_BUILD"
CLUSTER_SECRET_VAR = "PDSERVE_CLUSTER_SECRET"
REDIS_PASSWORD_VAR = "PDSERVE_REDIS_PASSWORD"
API_KEY_VAR = "PDSERVE_API_KEY"
# Set only while `pdserve up` starts its local Ray; the reaper reads it from /proc (cluster/ray_reaper.py).
LOCAL_RAY_MARK_VAR = "PDSERVE_LOCAL_RAY_MARK"


def cache_dir() -> Path:
    """Where converted models live: $PDSERVE_CACHE_DIR, default ~/.cache/pdserve. OSError, saying which variable
    to set, when there is no home to default to (no HOME, and a uid with no passwd entry: a container's)."""
    if configured := os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(configured)
    try:
        return Path.home() / ".cache" / "pdserve"
    except RuntimeError as e:
        raise OSError(f"{e} to put the model cache under (~/.cache/pdserve): set PDSERVE_CACHE_DIR") from None


def pod_ip() -> str | None:
    """POD_IP (Kubernetes' downward API): the address a process in a pod advertises unless told another."""
    return os.environ.get("POD_IP") or None


def pod_namespace() -> str | None:
    """POD_NAMESPACE (Kubernetes' downward API): the namespace a process in a pod runs in."""
    return os.environ.get("POD_NAMESPACE") or None


def raycluster() -> str | None:
    """PDSERVE_RAYCLUSTER: the RayCluster a chart's pod belongs to, as the chart rendered its name; None: unknown."""
    return os.environ.get("PDSERVE_RAYCLUSTER") or None


def ray_logs_dir() -> str:
    """Where a local Ray started here keeps its latest session's logs: under RAY_TMPDIR, else the temp dir, as Ray
    places them."""
    return os.path.join(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir(), "ray", "session_latest", "logs")


def ray_auth_mode() -> str | None:
    """RAY_AUTH_MODE: Ray's token authentication as the operator set it (its own default when None), for the log
    line that says authentication is off."""
    return os.environ.get("RAY_AUTH_MODE")


def ray_use_tls() -> bool:
    """RAY_USE_TLS, as Ray reads it: whether this process speaks TLS to Ray (a join's error names a mismatch)."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


@contextmanager
def local_ray_mark(mark: str) -> Iterator[None]:
    """PDSERVE_LOCAL_RAY_MARK=`mark` in this process's environment while `pdserve up` starts its local Ray, so that
    every process Ray starts meanwhile, and theirs, inherit it: what marks them as the reaper's to kill. As it was
    afterwards, so that nothing started later (another Ray) is taken for them."""
    before = os.environ.get(LOCAL_RAY_MARK_VAR)
    os.environ[LOCAL_RAY_MARK_VAR] = mark
    try:
        yield
    finally:
        if before is None:
            del os.environ[LOCAL_RAY_MARK_VAR]
        else:
            os.environ[LOCAL_RAY_MARK_VAR] = before


def inherited_with(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with `extra` added or replaced: a child process's that must see it all (its
    secrets too), as one started without an env of its own would, and `extra` besides (a PYTHONPATH that finds
    this very pdserve)."""
    return {**os.environ, **extra}


def build() -> str | None:
    """PDSERVE_BUILD: the deployment's name for this build (the chart: the image and its worker pods' digest);
    None: unnamed."""
    return os.environ.get(BUILD_VAR) or None


def pass_worker_logs_through() -> None:
    """Before Ray is first imported (it reads these then): worker lines reach the driver's stderr as they are, in
    order. Each is one JSON object naming its worker, which Ray's "(WorkerRuntime pid=...)" prefix made
    unparseable and its dedup held back or folded. An operator's own setting wins."""
    os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def worker_env() -> dict[str, str]:
    """The variables a launched worker process must see as the launcher does (model cache, telemetry), which Ray's
    runtime env hands it. Not the build: a worker's is its own node's, which an older image's node must not be told
    it runs. Not a secret (`is_secret`): Ray's runtime-env agent logs the env it makes, and its GCS keeps it; local
    workers inherit secrets from the process that starts Ray, and a joined Ray cluster's nodes carry their own (the
    chart's pods do)."""
    return {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("PDSERVE_", "OTEL_")) and k != BUILD_VAR and not is_secret(k)
    }


def is_secret(name: str) -> bool:
    """The cluster secret, the Redis password, an API key, and OTLP exporter headers (a collector's credentials)."""
    return name in (CLUSTER_SECRET_VAR, REDIS_PASSWORD_VAR, API_KEY_VAR) or (
        name.startswith("OTEL_EXPORTER_OTLP_") and name.endswith("_HEADERS")
    )


class VariableError(ValueError):
    """A setting given by an environment variable that is wrong, said naming the variable, as the operator set it,
    and its value (unless a secret): a command exits 2 on it, as on a flag's (`flags.flags_named`)."""

    def __init__(self, name: str, problem: str) -> None:
        shown = name if is_secret(name) else f"{name}={os.environ.get(name, '')!r}"
        super().__init__(f"{shown} {problem}")


@contextmanager
def variables_named(variables: Mapping[str, str]) -> Iterator[None]:
    """A ConfigError raised meanwhile about a field that one of `variables` (field: variable) set names that variable
    and its value, not the field."""
    try:
        yield
    except ConfigError as e:
        name = variables.get(e.setting)
        if name is None or not os.environ.get(name):  # not set by a variable: the code's default
            raise
        raise VariableError(name, e.problem) from None


_FAULT_VARIABLES = {  # FaultConfig's fields, each set by this variable
    "kv_send_delay_s": "PDSERVE_FAULT_KV_SEND_DELAY_S",
    "request_id_prefix": "PDSERVE_FAULT_REQUEST_ID_PREFIX",
    "engine_die_prefix": "PDSERVE_FAULT_ENGINE_DIE_REQUEST_ID_PREFIX",
    "slow_step_prefix": "PDSERVE_FAULT_SLOW_STEP_REQUEST_ID_PREFIX",
    "slow_step_s": "PDSERVE_FAULT_SLOW_STEP_S",
    "first_start_fails_dir": "PDSERVE_FAULT_FIRST_START_FAILS_DIR",
    "slow_profile_worker_id": "PDSERVE_FAULT_SLOW_PROFILE_WORKER_ID",
    "slow_profile_times": "PDSERVE_FAULT_SLOW_PROFILE_TIMES",
}


def fault_config() -> FaultConfig:
    """Testing and chaos knobs, all off unless set; they let tests fail a real cluster at a chosen moment.

    PDSERVE_FAULT_KV_SEND_DELAY_S: a prefill worker sleeps this many seconds after streaming a request's first
      token and before sending its KV, so a test can outwait the decode side's transfer timeout or kill the
      worker mid-transfer without racing a sub-millisecond send.
    PDSERVE_FAULT_REQUEST_ID_PREFIX: only requests whose id starts with this are faulted (default: every one),
      so healthy requests can run beside faulted ones on the same cluster.
    PDSERVE_FAULT_ENGINE_DIE_REQUEST_ID_PREFIX: a worker's engine step raises (its engine thread dies, as on a
      real step failure) when it runs a request whose client request id starts with this; unset: never.
    PDSERVE_FAULT_SLOW_STEP_REQUEST_ID_PREFIX, PDSERVE_FAULT_SLOW_STEP_S: a decode or prefill worker's engine step
      that runs a request whose client request id starts with the prefix takes this many seconds longer (a slow
      device), so a test's streams, or its prompts, last long enough for what it does meanwhile; unset: never.
    PDSERVE_FAULT_FIRST_START_FAILS_DIR: each worker's first start fails (after it leaves a file named after it
      in this folder, so its restart by Ray succeeds); unset: never.
    PDSERVE_FAULT_SLOW_PROFILE_WORKER_ID, PDSERVE_FAULT_SLOW_PROFILE_TIMES: that worker's start-up profile prices
      its steps this many times what it measured (as one timed while other processes loaded its host); unset: never.
    """
    values: dict[str, Any] = {f: v for f, name in _FAULT_VARIABLES.items() if (v := os.environ.get(name))}
    for f in ("kv_send_delay_s", "slow_step_s", "slow_profile_times"):
        if f in values:
            try:
                values[f] = float(values[f])
            except ValueError:
                unit = " of seconds" if f.endswith("_s") else ""
                raise VariableError(_FAULT_VARIABLES[f], f"must be a number{unit}") from None
    with variables_named(_FAULT_VARIABLES):
        return FaultConfig(**values)


# OTEL_TRACES_EXPORTER's names -> an exporter and the OTLP protocol it fixes (None: OTEL_EXPORTER_OTLP_PROTOCOL's).
_EXPORTERS = {
    "otlp": ("otlp", None),
    "otlp_proto_http": ("otlp", "http/protobuf"),  # opentelemetry-python's own names
    "otlp_proto_grpc": ("otlp", "grpc"),
    "console": ("console", None),
}


def otel_traces_exporters() -> tuple[tuple[str, str | None], ...]:
    """The span exporters the standard OTEL_* variables ask for, each as (kind, OTLP protocol or None): "otlp"
    or "console" (OTEL_TRACES_EXPORTER is a comma-separated list); none: export nothing. Unset, an OTLP endpoint
    alone means OTLP; "none" turns exporting off. A name pdserve has no exporter for is logged and skipped."""
    named = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not named:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return (("otlp", None),) if endpoint else ()
    for unknown in sorted(set(named) - {*_EXPORTERS, "none"}):
        logging.getLogger(__name__).warning("OTEL_TRACES_EXPORTER names %r, which pdserve has no exporter for", unknown)
    return tuple(dict.fromkeys(_EXPORTERS[n] for n in named if n in _EXPORTERS))


def otel_traces_protocol() -> str:
    """grpc or http/protobuf (the OpenTelemetry default)."""
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()


def api_key() -> str | None:
    """PDSERVE_API_KEY: the key clients send when no --api-key is given (keeps it out of `ps` output)."""
    return os.environ.get(API_KEY_VAR) or None


def cluster_secret() -> bytes:
    """PDSERVE_CLUSTER_SECRET: proves a caller is a cluster peer (security/cluster_secret.py); b"": none."""
    return os.environ.get(CLUSTER_SECRET_VAR, "").encode()


CLUSTER_SECRET_MIN_CHARS = 16


def check_cluster_secret() -> None:
    """ValueError for a cluster secret that is set but too short to keep anyone out: an empty one (an operator's
    Secret with an empty key) would run the cluster open, as if none were set, where one was meant."""
    secret = os.environ.get(CLUSTER_SECRET_VAR)
    if secret is not None and len(secret) < CLUSTER_SECRET_MIN_CHARS:
        raise VariableError(
            CLUSTER_SECRET_VAR,
            f"is set but has {len(secret)} characters, under the {CLUSTER_SECRET_MIN_CHARS} "
            "a cluster secret needs (the chart makes 48 random ones); set a longer one on every process, or unset "
            "it (`pdserve up` then makes one per run; elsewhere the cluster runs open)",
        )


def ensure_cluster_secret() -> None:
    """`pdserve up`: a fresh random secret for this run unless one is set; the Ray it starts, and so its workers,
    inherit it from this process's environment (never through Ray: `worker_env`)."""
    if not os.environ.get(CLUSTER_SECRET_VAR):
        os.environ[CLUSTER_SECRET_VAR] = secrets.token_hex(32)


_INTERNAL_TLS_VARS = ("PDSERVE_INTERNAL_TLS_CERT", "PDSERVE_INTERNAL_TLS_KEY", "PDSERVE_INTERNAL_TLS_CA")
_INTERNAL_TLS_SERVER_NAME_VAR = "PDSERVE_INTERNAL_TLS_SERVER_NAME"
_INTERNAL_TLS = "PDSERVE_INTERNAL_TLS_{CERT,KEY,CA}"


def internal_tls() -> tuple[str, str, str] | None:
    """PDSERVE_INTERNAL_TLS_{CERT,KEY,CA}: PEM files for mTLS on every internal hop; None when unset."""
    cert, key, ca = (os.environ.get(v, "") for v in _INTERNAL_TLS_VARS)
    return (cert, key, ca) if cert and key and ca else None


def internal_tls_server_name() -> str | None:
    """PDSERVE_INTERNAL_TLS_SERVER_NAME: the name every internal peer's certificate carries, checked instead of
    the address dialled; None: the certificate must name that address."""
    return os.environ.get(_INTERNAL_TLS_SERVER_NAME_VAR) or None


def export_internal_tls(cert: str, key: str, ca: str, server_name: str | None) -> None:
    """`pdserve up --internal-tls-*`: before Ray starts, so the workers (and this process's channels) read them."""
    for name, value in zip(_INTERNAL_TLS_VARS, (cert, key, ca), strict=True):
        os.environ[name] = value
    if server_name:
        os.environ[_INTERNAL_TLS_SERVER_NAME_VAR] = server_name


def redis_password() -> str | None:
    """PDSERVE_REDIS_PASSWORD: the registry's Redis password when its URL carries none (a URL's own wins)."""
    return os.environ.get(REDIS_PASSWORD_VAR) or None


def redis_ca_cert() -> str | None:
    """PDSERVE_REDIS_CA_CERT: a PEM file of the CA(s) a `rediss://` Redis's certificate is checked against, for
    one no public CA signed; None: the system's CAs. An `ssl_ca_certs` in the URL's query wins."""
    return os.environ.get("PDSERVE_REDIS_CA_CERT") or None


def check_variables(redis_url: str | None, internal_tls_flags: bool) -> None:
    """VariableError for a variable whose setting is wrong, before a cluster command starts anything: the cluster
    secret, the fault knobs, a `rediss://` Redis's CA file (`redis_url`'s), and the internal TLS files, unless
    `internal_tls_flags` were given (they replace them). Such a value failed later, as a worker's start or a
    Redis that "does not answer", naming a flag or nothing; an internal TLS file set without the other two ran the
    cluster in plaintext."""
    check_cluster_secret()
    fault_config()
    if redis_url is not None and redis_url.startswith("rediss://"):
        _check_readable("PDSERVE_REDIS_CA_CERT")
    if internal_tls_flags:
        return
    named = [name for name in (*_INTERNAL_TLS_VARS, _INTERNAL_TLS_SERVER_NAME_VAR) if os.environ.get(name)]
    if named and (missing := [name for name in _INTERNAL_TLS_VARS if not os.environ.get(name)]):
        raise VariableError(
            named[0], f"is set but {' and '.join(missing)} not: set all three of {_INTERNAL_TLS} or none"
        )
    for name in _INTERNAL_TLS_VARS:
        _check_readable(name)


def _check_readable(name: str) -> None:
    """The file the variable names, if set, can be read by this process."""
    if path := os.environ.get(name):
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise VariableError(name, f"cannot be read ({e.strerror})") from None

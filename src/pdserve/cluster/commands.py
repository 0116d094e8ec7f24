"""The flags of the commands that run cluster processes: `pdserve up` (all in one), `pdserve controller` (the
worker fleet in a Ray cluster) and `pdserve router` (the public API from the Redis registry)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from pdserve.config import CLUSTER_MODES, ClusterConfig, EngineConfig
from pdserve.flags import deadline_seconds, kv_cache_gb, natural, seconds
from pdserve.redaction import redacted_url

Run = Callable[[argparse.Namespace], Any]


def add_fleet_flags(p: argparse.ArgumentParser) -> None:
    """The workers' shape, their Ray placement and their registry: what `up` and `controller` share."""
    c = ClusterConfig
    p.add_argument("--mode", choices=CLUSTER_MODES, default=c.mode, help="separate prefill/decode workers, or not")
    # The counts are unset (None) unless given, so that a count only the other mode takes is refused, not ignored
    p.add_argument("--prefill", type=int, help=f"prefill workers (disaggregated; default: {c.prefill})")
    p.add_argument("--decode", type=int, help=f"decode workers (disaggregated; default: {c.decode})")
    p.add_argument("--workers", type=int, help=f"workers doing both phases (colocated; default: {c.workers})")
    p.add_argument(
        "--kv-cache-gb", type=kv_cache_gb, default=EngineConfig.kv_cache_memory_gb, help="KV cache per worker (GiB)"
    )
    p.add_argument(
        "--ray-namespace", default=c.ray_namespace, help="Ray namespace the worker actors are named (and found) in"
    )
    p.add_argument(
        "--role-resources",
        action="store_true",
        help="each actor asks for Ray custom resource pdserve_prefill / pdserve_decode / pdserve_colocated "
        "(1), so each role runs only on Ray nodes started with it",
    )
    p.add_argument(
        "--build-resources",
        action="store_true",
        help="each actor also asks for Ray custom resource pdserve_build_<first 12 hex of sha256(PDSERVE_BUILD)>, "
        "so workers start only on Ray nodes of this build (a new image's on new pods)",
    )
    p.add_argument(
        "--worker-port",
        type=int,
        default=c.worker_port,
        help="workers' gRPC port, the next ones for more per host (0: free ports)",
    )
    p.add_argument(
        "--transfer-port",
        type=int,
        default=c.transfer_port,
        help="a decode worker's KV rendezvous port, the next ones for more prefill peers (0: free ports)",
    )
    p.add_argument(
        "--worker-metrics-port",
        type=int,
        default=c.worker_metrics_port,
        help="workers' /metrics port, the next ones for more per host (0: free ports)",
    )
    p.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=c.kv_transfer_timeout_s,
        help="seconds a KV transfer may wait to start, and then take on the wire, before it fails",
    )
    p.add_argument(
        "--worker-drain-timeout-s",
        type=seconds,
        default=c.worker_drain_timeout_s,
        help="seconds a SIGTERMed worker lets its requests finish before the rest move elsewhere",
    )
    p.add_argument(
        "--speed-recheck-s",
        type=seconds,
        default=c.speed_recheck_s,
        help="an idle prefill or colocated worker times a prompt of its own to correct its speed, at most this often "
        "after its speed was last read (0: never)",
    )
    p.add_argument(
        "--speed-recheck-idle-s",
        type=deadline_seconds,
        default=c.speed_recheck_idle_s,
        help="seconds a worker runs and holds nothing before it may time such a prompt",
    )
    p.add_argument(
        "--rollout-surge-wait-s",
        type=seconds,
        default=c.rollout_surge_wait_s,
        help="a rollout starts a role's only worker's successor first if a Ray node takes it within this; "
        "else (or 0) that worker restarts in place",
    )
    p.add_argument(
        "--max-restarts",
        type=natural,
        default=c.max_restarts,
        help="times Ray restarts a worker that died; past that the launcher replaces it with a new one",
    )


_MODE_COUNTS = {"disaggregated": ("prefill", "decode"), "colocated": ("workers",)}


def check_mode_counts(args: argparse.Namespace) -> None:
    """A worker count given for the other mode is a ValueError naming both flags: `up --mode colocated --prefill 3`
    started the 2 workers of --workers' default. A command without fleet flags (`router`) has none to check."""
    own = _MODE_COUNTS.get(getattr(args, "mode", ""), ())
    for mode, names in _MODE_COUNTS.items():
        if given := [f"--{n}" for n in names if n not in own and getattr(args, n, None) is not None]:
            takes = " and ".join(f"--{n}" for n in own)
            raise ValueError(f"{given[0]} counts --mode {mode}'s workers; --mode {args.mode} takes {takes}")


def registry_unanswered(config: ClusterConfig, command: str) -> int:
    """`pdserve up` with --redis, before it fetches the model or starts Ray (which took 6 s to start and stop again
    before the first call to Redis failed): 0 when its Redis answers, else 1, said in one line naming the flag and
    the address. (`pdserve router` waits for its Redis instead, unready; `pdserve controller` waits too, for up to
    its join window: `registry.redis_reachable.wait_until_answers`.)"""
    from redis.exceptions import ConnectionError as RedisUnreachable

    from pdserve.registry.redis_reachable import check_answers

    try:
        if config.redis_url:
            check_answers(config.redis_url)
    except RedisUnreachable as e:
        print(f"{command}: --redis {redacted_url(config.redis_url or '')}: {e}", file=sys.stderr)
        return 1
    return 0


def check_ports_distinct(own: dict[str, int | None], command: str, config: ClusterConfig) -> None:
    """Two port flags naming one port are a ValueError naming both, before anything binds (the second bind's
    failure named one). `own`: the command's own listeners, by flag. A worker binds its three ports together;
    `up`'s workers run beside its router unless it joins a Ray cluster (--ray-address: perhaps on other hosts)."""
    workers: dict[str, int | None] = {}
    if command != "router":  # a router starts no worker
        workers = {"--worker-port": config.worker_port, "--transfer-port": config.transfer_port}
        workers["--worker-metrics-port"] = config.worker_metrics_port
    for ports in [own | workers] if command == "up" and not config.ray_address else [own, workers]:
        flags: dict[int | None, str] = {}
        for flag, port in ports.items():
            if port and port in flags:  # 0 or None: a free port, or none
                raise ValueError(f"{flags[port]} and {flag} are both {port}: give each a port of its own")
            flags[port] = flag


def add_address_flags(p: argparse.ArgumentParser, host_alias: bool = False) -> None:
    """Where every listener binds and which host its addresses name. `host_alias`: `up`'s older --host too."""
    names = ["--bind-host", "--host"] if host_alias else ["--bind-host"]
    p.add_argument(*names, dest="host", default=ClusterConfig.host, help="address every listener binds (0.0.0.0: all)")
    p.add_argument(
        "--advertise-host",
        default=None,
        help="host the addresses others dial name (default: env POD_IP, else the bind host unless 0.0.0.0/::, "
        "then this machine's primary address)",
    )


def add_internal_tls_flags(p: argparse.ArgumentParser) -> None:
    """mTLS with the cluster CA on every internal hop; every process of a cluster takes the same three files (and
    the same server name)."""
    p.add_argument("--internal-tls-cert", help="PEM certificate every worker and the router present internally")
    p.add_argument("--internal-tls-key", help="PEM key of --internal-tls-cert")
    p.add_argument("--internal-tls-ca", help="PEM cluster CA: internal peers must hold a certificate it signed (mTLS)")
    p.add_argument(
        "--internal-tls-server-name",
        help="the name --internal-tls-cert carries: internal channels check peers' certificates for it instead of "
        "the address they dial (default: that address)",
    )


def add_drain_grace_flag(p: argparse.ArgumentParser) -> None:
    """How long a SIGTERMed router lets its streams finish: what a pod's termination grace period leaves it."""
    p.add_argument(
        "--drain-grace-s",
        type=float,
        default=ClusterConfig.drain_grace_s,
        help="seconds a SIGTERMed router stays NOT_SERVING while its in-flight streams finish, before it stops",
    )


def add_http_flags(p: argparse.ArgumentParser) -> None:
    """The OpenAI-compatible HTTP API's port and which web pages a browser lets call it (CORS): `up` and `router`.
    The CORS flags are unset (None) unless given, so a --router-config file's values stand."""
    p.add_argument(
        "--http-port",
        type=int,
        default=ClusterConfig.http_port,
        help="serve the OpenAI-compatible HTTP API on this port (0: off)",
    )
    p.add_argument(
        "--http-cors-origins",
        action="extend",
        type=_comma_separated,
        metavar="ORIGIN[,ORIGIN...]",
        help="let browser pages from these origins (scheme://host[:port]; scheme://*.domain for the hosts under it; "
        "or *) call the HTTP API: CORS headers on its responses; repeatable (default: none, no CORS headers)",
    )
    p.add_argument(
        "--http-cors-allow-credentials",
        action="store_const",
        const=True,
        help="let those pages send cookies and client certificates too (not with *; an API key needs no credentials)",
    )


def _comma_separated(value: str) -> list[str]:
    return [item.strip() for item in value.split(",")]


def add_controller_command(sub: Any, run: Run, add_engine_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    c = ClusterConfig
    p = sub.add_parser("controller", help="create and supervise the worker actors in a Ray cluster (no router)")
    add_engine_flags(p)
    p.add_argument("--ray-address", required=True, help="the Ray cluster to join (HOST:PORT of its GCS, or auto)")
    p.add_argument("--redis", required=True, help="redis://... registry the workers publish to, routers read")
    add_fleet_flags(p)
    add_address_flags(p)
    add_internal_tls_flags(p)
    p.add_argument("--metrics-port", type=int, default=None, help="serve the controller's metrics at :P/metrics")
    p.add_argument(
        "--stop-workers-on-exit",
        action="store_true",
        help="stop the worker actors on SIGTERM (default: leave them serving for the next controller)",
    )
    p.add_argument("--log-level", default=c.log_level, help="DEBUG, INFO, WARNING, ERROR (JSON lines on stderr)")
    p.set_defaults(func=run, command="controller")


def add_router_command(sub: Any, run: Run, add_router_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    c = ClusterConfig
    p = sub.add_parser("router", help="serve the public API from the Redis registry (several may run)")
    p.add_argument("--model", default=EngineConfig.model, help="the model the workers serve (its tokenizer)")
    p.add_argument("--redis", required=True, help="redis://... registry the workers publish to")
    add_address_flags(p, host_alias=True)
    p.add_argument("--port", type=int, default=c.port, help="the router's gRPC port")
    p.add_argument("--metrics-port", type=int, default=c.metrics_port, help="serve the router's metrics at :P/metrics")
    add_http_flags(p)
    add_router_flags(p)
    add_internal_tls_flags(p)
    add_drain_grace_flag(p)
    p.add_argument("--log-level", default=c.log_level, help="DEBUG, INFO, WARNING, ERROR (JSON lines on stderr)")
    p.set_defaults(func=run, command="router")

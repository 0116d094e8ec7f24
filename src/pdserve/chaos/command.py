"""`pdserve chaos`: its flags, the cluster it starts (or the router it attaches to), and the report it prints."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
from pathlib import Path

import grpc

from pdserve.addresses import host_port
from pdserve.chaos.run import ChaosConfig
from pdserve.config import RouterConfig
from pdserve.flags import (
    at_least_one,
    deadline_seconds,
    from_flags,
    kv_cache_gb,
    natural,
    positive_float,
    request_rate,
    seconds,
)

# The cluster `pdserve chaos` starts when given no --addr: small, with router bounds a stop outlasts.
FIRST_TOKEN_TIMEOUT_S = 20.0


def add_chaos_command(sub: argparse._SubParsersAction) -> None:
    c = ChaosConfig
    p = sub.add_parser("chaos", help="steady load while workers are killed and stopped; what the clients got")
    p.add_argument(
        "--addr",
        type=host_port,
        default=None,
        help="a running router HOST:PORT on this host (default: start a cluster)",
    )
    p.add_argument("--model", default="tiny-random", help="the served model (for the cluster it starts, and vocab)")
    p.add_argument("--prefill", type=at_least_one, default=2, help="prefill workers of the cluster it starts")
    p.add_argument("--decode", type=at_least_one, default=2, help="decode workers of the cluster it starts")
    p.add_argument("--kv-cache-gb", type=kv_cache_gb, default=0.05, help="KV cache GiB per started worker")
    p.add_argument(
        "--stall-timeout-s",
        type=positive_float,
        default=RouterConfig.stall_timeout_s,
        help="the started router's stall bound",
    )
    p.add_argument(
        "--first-token-timeout-s", type=positive_float, default=FIRST_TOKEN_TIMEOUT_S, help="the started router's bound"
    )
    p.add_argument("--kills", type=natural, default=c.kills, help="SIGKILLs of random workers, one at a time")
    p.add_argument("--interval", type=seconds, default=c.interval_s, help="seconds from a recovery to the next fault")
    p.add_argument("--stops", type=natural, default=c.stops, help="SIGSTOPs (decode first, then alternating roles)")
    p.add_argument("--stop-s", type=deadline_seconds, default=c.stop_s, help="seconds a stopped worker stays stopped")
    p.add_argument("--rate", type=request_rate, default=c.rate, help="greedy requests per second, Poisson")
    p.add_argument("--prompts", type=at_least_one, default=c.prompts, help="distinct prompts the requests draw from")
    p.add_argument("--input-len", type=at_least_one, default=c.input_len, help="prompt tokens")
    p.add_argument("--output-len", type=at_least_one, default=c.output_len, help="tokens generated per request")
    p.add_argument("--seed", type=natural, default=c.seed, help="of the faults' and arrivals' random draws")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the started cluster's log here")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run_command)


def chaos_config(args: argparse.Namespace) -> ChaosConfig:
    return from_flags(ChaosConfig, args, {"interval_s": "interval"})


def run_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdserve.chaos.report import clean, print_report
    from pdserve.log_setup import configure_logging

    configure_logging("INFO", service="pdserve-chaos")
    config = chaos_config(args)
    try:
        report = _run(config, args)
    except grpc.aio.AioRpcError as e:  # the router it was given (or started) did not answer
        print(f"pdserve chaos: the router: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except (RuntimeError, OSError, ValueError) as e:
        print(f"pdserve chaos: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report, Console())
    return 0 if clean(report) else 1


def cluster_args(
    model: str = "tiny-random",
    prefill: int = 2,
    decode: int = 2,
    kv_cache_gb: float = 0.05,
    stall_timeout_s: float = RouterConfig.stall_timeout_s,
    first_token_timeout_s: float = FIRST_TOKEN_TIMEOUT_S,
) -> list[str]:
    """`pdserve up` flags of the cluster chaos starts (its flags' defaults are these)."""
    return [
        *("--model", model, "--prefill", str(prefill), "--decode", str(decode), "--kv-cache-gb", str(kv_cache_gb)),
        *("--stall-timeout-s", str(stall_timeout_s), "--first-token-timeout-s", str(first_token_timeout_s)),
    ]


def _run(config: ChaosConfig, args: argparse.Namespace) -> dict:
    from pdserve.chaos.run import run_chaos
    from pdserve.cluster.local_process import ClusterProcess
    from pdserve.engine.model_files import read_model_config
    from pdserve.engine.models import resolve_model

    model = read_model_config(resolve_model(args.model))
    if (tokens := args.input_len + args.output_len) > model.max_position_embeddings:
        # Before any cluster starts: every request would be refused, and an --output-len past the wire's uint32
        # was a ValueError traceback once the load began
        raise ValueError(
            f"--input-len {args.input_len} + --output-len {args.output_len} = {tokens} tokens exceed {args.model}'s "
            f"context of {model.max_position_embeddings}: the router would refuse every request"
        )
    vocab_size = model.vocab_size
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as SIGINT: the cluster started here is stopped
    if args.addr:
        return asyncio.run(run_chaos(config, args.addr, vocab_size))
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        up = cluster_args(
            args.model, args.prefill, args.decode, args.kv_cache_gb, args.stall_timeout_s, args.first_token_timeout_s
        )
        cluster = ClusterProcess(*up, log_path=log_dir / "cluster.log")
        try:
            report = asyncio.run(run_chaos(config, cluster.address, vocab_size))
        finally:
            cluster.stop()
    return report | {"cluster": up}

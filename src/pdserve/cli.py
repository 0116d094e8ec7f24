"""The `pdserve` command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from pdserve import __version__, env
from pdserve.bench.commands import add_bench_commands
from pdserve.build import current_build
from pdserve.chaos.command import add_chaos_command
from pdserve.client_commands import add_client_commands
from pdserve.cluster.commands import (
    add_address_flags,
    add_controller_command,
    add_drain_grace_flag,
    add_fleet_flags,
    add_http_flags,
    add_internal_tls_flags,
    add_router_command,
    check_mode_counts,
    check_ports_distinct,
    registry_unanswered,
)
from pdserve.config import STALL_TIMEOUT_MIN_S, ClusterConfig, EngineConfig, RouterConfig
from pdserve.drain_commands import add_drain_commands
from pdserve.env import REDIS_PASSWORD_VAR
from pdserve.flags import (
    DefaultsFormatter,
    add_engine_flags,
    add_sampling_flags,
    check_readable,
    engine_config,
    fetch_model,
    flag_values,
    flags_named,
    from_flags,
    model_unready,
    sampling_from_flags,
)
from pdserve.planner.commands import add_planner_commands
from pdserve.redaction import has_password, redacted_url

if TYPE_CHECKING:
    from pdserve.cluster.factories import ClusterServices


def main(argv: Sequence[str] | None = None, services: ClusterServices | None = None) -> int:
    """`services`: what `pdserve up` runs, composed outside this package (services/main.py, the `pdserve`
    command); without them every command but `up` works."""
    args = _parser(services).parse_args(argv)
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe can be answered, not at exit
        return status
    except BrokenPipeError:  # `pdserve status --json | head`: the reader left, which is no error to trace
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit fails quietly
        return 1


class _Parser(argparse.ArgumentParser):
    """Every command's and subcommand's --help shows the defaults, which come from the config dataclasses."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


class _Version(argparse.Action):
    """`--version`: the package's version and the build this process reports (PDSERVE_BUILD, else the version and a
    digest of the source), which `pdserve status --json` and pdserve_build_info show of running ones."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(f"pdserve {__version__} (build {current_build()})")
        parser.exit()


def _parser(services: ClusterServices | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version and build, then exit")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="run prompts through the engine in one process, one continuous batch")
    add_engine_flags(gen)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt, at most")
    add_sampling_flags(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    gen.set_defaults(func=_generate)

    up = sub.add_parser("up", help="start a local cluster: Ray worker actors and the router")
    add_engine_flags(up)
    c = ClusterConfig
    add_fleet_flags(up)
    add_address_flags(up, host_alias=True)
    up.add_argument("--port", type=int, default=c.port, help="the router's gRPC port")
    up.add_argument("--metrics-port", type=int, default=c.metrics_port, help="serve the router's metrics at :P/metrics")
    add_http_flags(up)
    up.add_argument("--redis", default=c.redis_url, help="redis://... registry (default: in-process)")
    up.add_argument(
        "--ray-address",
        default=c.ray_address,
        help="join this Ray cluster instead of starting one (the worker actors are then detached)",
    )
    add_internal_tls_flags(up)
    add_drain_grace_flag(up)
    _add_router_flags(up)
    up.add_argument("--log-level", default=c.log_level, help="DEBUG, INFO, WARNING, ERROR (JSON lines on stderr)")
    up.set_defaults(func=partial(_serve, services=services), command="up")
    add_controller_command(sub, partial(_serve, services=services), add_engine_flags)
    add_router_command(sub, partial(_serve, services=services), _add_router_flags)

    add_client_commands(sub)

    fetch = sub.add_parser("fetch", help="fetch and convert a built-in model into the cache, once")
    fetch.add_argument("--model", default=EngineConfig.model, help="a built-in model name")
    fetch.add_argument(
        "--force", action="store_true", help="build it again even when the cache holds it complete (a damaged file)"
    )
    fetch.set_defaults(func=_fetch)

    add_bench_commands(sub)
    add_chaos_command(sub)
    add_drain_commands(sub)
    add_planner_commands(sub)
    return parser


def _add_router_flags(p: argparse.ArgumentParser) -> None:
    """Unset (None) unless given, so a --router-config file's values stand; the help shows RouterConfig's."""
    r = RouterConfig
    p.add_argument(
        "--router-config", default=None, help="TOML file with a [router] table (see docs/router.md#configuration)"
    )
    p.add_argument("--policy", choices=["slo", "round-robin"], help=f"placement policy (default: {r.policy})")
    p.add_argument(
        "--default-ttft-ms", type=float, help=f"TTFT SLO for requests that set none (default: {r.default_ttft_ms:g})"
    )
    p.add_argument(
        "--default-tpot-ms", type=float, help=f"TPOT SLO for requests that set none (default: {r.default_tpot_ms:g})"
    )
    p.add_argument(
        "--max-queued-prefill-tokens", type=int, help=f"per prefill worker (default: {r.max_queued_prefill_tokens})"
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        help="placements a request may get when workers fail before its first token, the first included "
        f"(default: {r.max_attempts}; 1 never retries)",
    )
    p.add_argument(
        "--migration-limit",
        type=int,
        help="times a stream may move to another decode worker when its worker fails after tokens were sent "
        f"(default: {r.migration_limit}; 0 never migrates)",
    )
    p.add_argument(
        "--stall-timeout-s",
        type=float,
        help="treat a stream as broken (its decode worker ejected, the request migrated) when the worker sends "
        f"nothing this long after the first message (default: {r.stall_timeout_s:g}; at least "
        f"{STALL_TIMEOUT_MIN_S:g}: a worker says each second that a stream it preempted waits)",
    )
    p.add_argument(
        "--no-reflection",
        dest="reflection",
        action="store_const",
        const=False,
        help="turn gRPC server reflection off on the public port (on by default)",
    )
    p.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_const",
        const=False,
        help="log no line per request as it ends (the metrics still count them; failures still log a warning)",
    )
    p.add_argument(
        "--api-keys",
        dest="api_keys_file",
        metavar="FILE",
        help="TOML file of API keys (SHA-256 digests, tenants, limits; see docs/security.md#api-keys); without it the "
        "cluster is open",
    )
    p.add_argument("--tls-cert", help="PEM certificate: serve TLS on the public port (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA: require client certificates signed by it (mTLS)")
    p.add_argument(
        "--first-token-timeout-s",
        type=float,
        default=None,
        help="fail a request with UNAVAILABLE when no first token came by then and the client set no sooner "
        f"deadline (default: {r.first_token_timeout_s:g})",
    )


def _serve(args: argparse.Namespace, services: ClusterServices | None) -> int:
    """`pdserve up`, `controller` or `router` (args.command): a long-running process until SIGINT/SIGTERM."""
    from pdserve.addresses import release_held

    try:
        return _serve_held(args, services)
    finally:
        release_held()  # the ports it held, when it ended before its listeners took them


def _serve_held(args: argparse.Namespace, services: ClusterServices | None) -> int:
    import asyncio
    import logging

    from pdserve.log_setup import configure_logging

    name = f"pdserve {args.command}"
    if services is None:
        print(f"{name}: this entry point has no services to run; use the `pdserve` command", file=sys.stderr)
        return 2
    try:
        logging.getLevelName(args.log_level.upper()) + 0
    except TypeError:
        print(f"{name}: unknown --log-level {args.log_level!r} (DEBUG, INFO, WARNING or ERROR)", file=sys.stderr)
        return 2
    try:
        check_readable(args, _FILE_FLAGS)
        config = _cluster_config(args)
        _check_security_files(config)
        _check_redis_password(args.command, config)
        _check_ports_free(args.command, config)
    except (ValueError, OSError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, service=f"pdserve-{args.command}")
    if args.command == "up" and (failed := registry_unanswered(config, name)):
        return failed  # before the model's fetch and Ray: nothing started, nothing to stop
    # The model, here with progress on a terminal rather than in every worker; a controller's workers fetch it on
    # their own nodes.
    if args.command != "controller" and (failed := model_unready(args.model, name)):
        return failed
    from redis.exceptions import ConnectionError as RedisUnreachable

    from pdserve.cluster.launcher import WorkerStartError

    try:
        asyncio.run(_runner(args.command)(config, services))
    # A listener that could not bind after all (taken since the check), a worker that never served (its reasons
    # are logged above), a Redis not there: one line, not a trace.
    except (OSError, WorkerStartError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    except RedisUnreachable as e:
        print(f"{name}: --redis {redacted_url(config.redis_url or '')}: {e}", file=sys.stderr)
        return 1
    return 0


def _runner(command: str) -> Callable[[ClusterConfig, ClusterServices], Coroutine[Any, Any, None]]:
    if command == "controller":
        from pdserve.cluster.controller import run_controller

        return run_controller
    if command == "router":
        from pdserve.cluster.router_process import run_router

        return lambda config, services: run_router(config, services.router)
    from pdserve.cluster.up import run_cluster

    return run_cluster


def _check_redis_password(command: str, config: ClusterConfig) -> None:
    """The commands that start workers through Ray hand each the registry's URL in its actor's arguments, which
    Ray's GCS keeps: a password there would go through Ray, which no secret does (a router's stays in its process)."""
    if command != "router" and config.redis_url and has_password(config.redis_url):
        raise ValueError(
            f"--redis {redacted_url(config.redis_url)}: give the password in {REDIS_PASSWORD_VAR}, not in the URL "
            "(the URL reaches every worker actor's arguments, which Ray keeps)"
        )


def _check_security_files(config: ClusterConfig) -> None:
    """Before any worker starts: a key file that does not parse, a TLS pair half given, a cluster secret too short
    to be one or another variable's setting that is wrong fails the command at once, naming it, instead of after
    the workers are up."""
    from pdserve.rpc.credentials import server_tls
    from pdserve.security.api_keys import KeyTable

    env.check_variables(config.redis_url, internal_tls_flags=bool(config.internal_tls_cert))
    r = config.router
    if r.api_keys_file:
        KeyTable.from_file(r.api_keys_file)
    server_tls(r.tls_cert, r.tls_key, r.tls_client_ca)


# The files `up`, `controller` and `router` read (those the command takes), checked before anything parses them.
_FILE_FLAGS = {
    "--router-config": "router_config", "--api-keys": "api_keys_file", "--tls-cert": "tls_cert", "--tls-key": "tls_key",
    "--tls-client-ca": "tls_client_ca", "--internal-tls-cert": "internal_tls_cert",
    "--internal-tls-key": "internal_tls_key", "--internal-tls-ca": "internal_tls_ca",
}  # fmt: skip


def _check_ports_free(command: str, config: ClusterConfig) -> None:
    """The command's own listeners (a controller serves only metrics), checked and held before Ray or a worker
    starts."""
    from pdserve.addresses import hold_free

    ports = {"--metrics-port": config.metrics_port}
    if command != "controller":
        ports |= {"--port": config.port, "--http-port": config.http_port}
    check_ports_distinct(ports, command, config)
    for flag, port in ports.items():
        hold_free(config.host, port or 0, flag)


def _cluster_config(args: argparse.Namespace) -> ClusterConfig:
    check_mode_counts(args)
    overrides = flag_values(RouterConfig, args)
    with flags_named(args):
        if getattr(args, "router_config", None):  # `controller` takes none
            router = RouterConfig.from_file(args.router_config, **overrides)
        else:
            router = RouterConfig(**overrides)
    renamed = {"redis_url": "redis", "kv_transfer_timeout_s": "kv_transfer_timeout"}
    return from_flags(
        ClusterConfig,
        args,
        renamed,
        engine=engine_config(args),
        router=router,
        log_level=args.log_level.upper(),
        http_port=getattr(args, "http_port", None) or None,  # `controller` serves no HTTP
        # `up` stops everything it started; a controller leaves its actors serving unless told otherwise
        stop_workers_on_exit=args.command != "controller" or args.stop_workers_on_exit,
    )


def _fetch(args: argparse.Namespace) -> int:
    """SIGTERM (what Kubernetes sends an init container) ends it as SIGINT would, through the build's cleanup: its
    staging folder (the download and half a model) is removed, not left in the cache."""
    import signal

    from pdserve.engine.model_files import BUILTIN_MODELS

    if args.force and args.model not in BUILTIN_MODELS:
        print(f"pdserve fetch: --force rebuilds built-in models only, not {args.model}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        path = fetch_model(args.model, "pdserve fetch", args.force)
    finally:  # `main` called in a process that goes on (a test's)
        signal.signal(signal.SIGTERM, previous)
    if path is None:  # a built-in's cache or download failed (1); any other name is no model, the user's to mend (2)
        return 1 if args.model in BUILTIN_MODELS else 2
    print(path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.model_cache import ModelFetchError
    from pdserve.errors import InvalidRequestError
    from pdserve.protocol.model_config import UnsupportedModelError

    try:
        sampling = sampling_from_flags(args, args.max_tokens)
        engine = LLMEngine(engine_config(args))
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([("user", p)]) if args.chat else tok.encode_prompt(p) for p in args.prompt]
        completions = engine.generate(prompts, sampling)
    except InvalidRequestError as e:
        print(f"pdserve generate: invalid {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, UnsupportedModelError) as e:  # the model named
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    except (ModelFetchError, OSError) as e:  # the cache: not writable, full, unreadable, no home for its default
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 1
    for prompt, c in zip(args.prompt, completions, strict=True):
        if args.json:
            reason = c.finish_reason.value
            record = {"prompt": prompt, "token_ids": c.token_ids, "text": c.text, "finish_reason": reason}
            if args.logprobs is not None:
                record["logprobs"] = [dataclasses.asdict(lp) for lp in c.logprobs]
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"### {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, {c.finish_reason.value}]\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

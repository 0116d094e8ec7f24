"""`pdserve client` and `pdserve status`: what a caller of a running cluster's router uses (the public API and the
Admin service), with the TLS and API-key flags every such command takes."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pdserve.addresses import host_port
from pdserve.errors import InvalidRequestError
from pdserve.flags import add_sampling_flags, deadline_seconds, sampling_from_flags
from pdserve.rpc.client_hints import exit_status, rpc_error_line
from pdserve.rpc.credentials import add_client_flags, client_credentials

MAX_TOKENS_FIELD = 2**32 - 1  # the wire's SamplingParams.max_tokens is a uint32


def add_client_commands(sub: Any) -> None:
    status = sub.add_parser("status", help="a running cluster's workers, their health and load")
    status.add_argument("--addr", type=host_port, required=True, help="router HOST:PORT")
    status.add_argument(
        "--json", action="store_true", help="print one JSON object: workers, in_flight, draining, desired, admitted"
    )
    status.add_argument("--timeout", type=deadline_seconds, default=10.0, help="seconds")
    add_client_flags(status)
    status.set_defaults(func=_status)

    client = sub.add_parser("client", help="stream an answer from a running cluster")
    client.add_argument("--addr", type=host_port, required=True, help="router HOST:PORT")
    client.add_argument("--prompt", required=True, help="the text to continue (with --chat: the message)")
    client.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    client.add_argument("--max-tokens", type=int, default=0, help="0 = the server's default")
    add_sampling_flags(client)
    client.add_argument("--timeout", type=deadline_seconds, default=None, help="deadline in seconds")
    client.add_argument("--json", action="store_true", help="print one JSON object: tokens, text, finish, TTFT, TPOT")
    add_client_flags(client)
    client.set_defaults(func=_client)


def _client(args: argparse.Namespace) -> int:
    import asyncio

    import grpc
    from google.protobuf.json_format import MessageToDict

    from pdserve.rpc.client import generate
    from pdserve.rpc.convert import sampling_to_pb
    from pdserve.v1 import generate_pb2 as pb

    try:  # checked here first, so a bad flag never leaves the machine
        if not args.prompt:
            raise InvalidRequestError("--prompt", "must not be empty")
        if not 0 <= args.max_tokens <= MAX_TOKENS_FIELD:
            raise InvalidRequestError(
                "--max-tokens", f"must be in [0, {MAX_TOKENS_FIELD}] (0: the server's default), got {args.max_tokens}"
            )
        sampling = sampling_to_pb(sampling_from_flags(args, max_tokens=max(args.max_tokens, 1)))
    except InvalidRequestError as e:
        print(f"pdserve client: invalid {e}", file=sys.stderr)
        return 2
    sampling.max_tokens = args.max_tokens  # 0: the server's default
    if args.chat:
        request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=args.prompt)], sampling=sampling)
    else:
        request = pb.GenerateRequest(prompt=args.prompt, sampling=sampling)

    credentials = client_credentials(args)

    async def run() -> int:
        result = None
        async for msg, running in generate(args.addr, request, args.timeout, credentials):
            result = running
            if not args.json:
                print(msg.text, end="", flush=True)
        assert result is not None
        ttft, tpot = result.ttft_s * 1e3, result.tpot_s * 1e3
        if args.json:
            record = {
                "token_ids": result.token_ids,
                "text": result.text,
                "finish_reason": result.finish_reason,
                "ttft_ms": ttft,
                "tpot_ms": tpot,
                "messages": result.messages,
            }
            if args.logprobs is not None:
                record["logprobs"] = [MessageToDict(lp, preserving_proto_field_name=True) for lp in result.logprobs]
            print(json.dumps(record, ensure_ascii=False))
        else:
            n = len(result.token_ids)
            print(f"\n[{n} tokens, {result.finish_reason}; TTFT {ttft:.0f} ms, TPOT {tpot:.1f} ms]")
        return 0

    try:
        return asyncio.run(run())
    except grpc.aio.AioRpcError as e:
        print(rpc_error_line("pdserve client", e.code().name, e.details() or "", credentials), file=sys.stderr)
        return exit_status(e.code().name)


STATUS_FIELDS = (
    "id",
    "role",
    "address",
    "health",
    "running",
    "waiting",
    "queued_prefill_tokens",
    "kv_blocks_used",
    "kv_blocks_cached",
    "kv_blocks_total",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "metrics_address",
    "pid",
    "state_age_s",
    "draining",
    "build",
    "features",
    "kv_wire_version",
    "tokenizer",
    "speed_factor",
)


def _status_field(w: Any, field: str) -> Any:
    """A worker's JSON value: a latency without a sample is null, as `pdserve plan --json` gives no data."""
    from pdserve.status_view import latency_ms

    if field.endswith("_ms"):
        return latency_ms(w, field)
    if field == "speed_factor" and not w.HasField(field):
        return None  # a router too old to say, not a worker at its profile's speed
    return list(w.features) if field == "features" else getattr(w, field)


def status_record(reply: Any) -> dict[str, Any]:
    """What `pdserve status --json` prints for the router's ClusterStatusResponse."""
    workers = [{f: _status_field(w, f) for f in STATUS_FIELDS} for w in reply.workers]
    admitted = {
        "requests": reply.admitted_requests,
        "prompt_tokens": reply.admitted_prompt_tokens,
        "max_tokens": reply.admitted_max_tokens,
        "finished": reply.finished_requests,
        "completion_tokens": reply.completion_tokens,
        "shed": reply.shed_requests,
        "shed_prompt_tokens": reply.shed_prompt_tokens,
    }
    record = {"workers": workers, "in_flight": reply.in_flight, "draining": reply.draining}
    admitted["local_only"] = reply.admitted_local_only  # the registry did not answer: this router's alone
    return {**record, "desired": dict(reply.desired), "admitted": admitted, "tokenizer": reply.tokenizer}


def _status(args: argparse.Namespace) -> int:
    import asyncio

    import grpc

    from pdserve.rpc.server import channel
    from pdserve.v1 import admin_pb2, admin_pb2_grpc

    credentials = client_credentials(args)

    async def ask() -> admin_pb2.ClusterStatusResponse:
        async with channel(args.addr, credentials=credentials) as ch:
            return await admin_pb2_grpc.AdminStub(ch).ClusterStatus(
                admin_pb2.ClusterStatusRequest(), timeout=args.timeout, metadata=credentials.metadata()
            )

    try:
        reply = asyncio.run(ask())
    except grpc.aio.AioRpcError as e:
        print(rpc_error_line("pdserve status", e.code().name, e.details() or "", credentials), file=sys.stderr)
        return exit_status(e.code().name)
    if args.json:
        print(json.dumps(status_record(reply)))
        return 0
    from rich.console import Console

    from pdserve.status_view import print_status

    print_status(reply, args.addr, Console())
    return 0

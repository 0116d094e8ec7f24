"""`python -m pdserve.rpc.health_probe --addr HOST:PORT [--service NAME]`: exit 0 when the server (or that one of
its services) answers SERVING, else 1.

The kubelet's own gRPC probe speaks plaintext only; with TLS on (the Helm chart's `tls.enabled`) pods probe
their gRPC health with this instead, presenting the pod's certificates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials:
    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))


def check(args: argparse.Namespace) -> bool:
    """One Health/Check of the server's overall status ("" service), or of `--service`, within the timeout."""
    if args.tls_ca or args.tls_cert:
        options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
        channel = grpc.secure_channel(args.addr, _credentials(args), options=options)
    else:
        channel = grpc.insecure_channel(args.addr)
    with channel:
        try:
            asked = health_pb2.HealthCheckRequest(service=args.service)
            reply = health_pb2_grpc.HealthStub(channel).Check(asked, timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.addr}: {e.code().name}", file=sys.stderr)
            return False
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.addr}: {status}", file=sys.stderr)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.rpc.health_probe", description=__doc__)
    p.add_argument("--addr", required=True, help="HOST:PORT of the gRPC server")
    p.add_argument("--tls-ca", help="CA bundle the server's certificate must chain to (turns TLS on)")
    p.add_argument("--tls-cert", help="client certificate, for a server that asks for one")
    p.add_argument("--tls-key", help="the client certificate's key")
    p.add_argument("--server-name", help="the name the server's certificate must carry (default: the host)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds")
    p.add_argument(
        "--service",
        default="",
        help="a service's own health, e.g. pdserve.v1.Generation: NOT_SERVING on a router without live workers "
        "(default: the server's)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    return 0 if check(parser().parse_args(argv)) else 1


if __name__ == "__main__":
    sys.exit(main())

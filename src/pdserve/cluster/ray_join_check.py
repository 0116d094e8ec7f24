"""A joined Ray's first call, made before `ray.init` joins it: whether it takes this process's Ray auth token.

Ray Client reads the head's UNAUTHENTICATED as a head that does not answer: it tries again until its connection
timeout (30 s), and a controller's join, which tries a head that does not answer again, did so for 5 minutes, its
log saying only "ray client connection timeout" (a joined GCS address: 20 s a try, "Failed to connect"). One call
on Ray's own channel (its token interceptor, its RAY_USE_TLS settings) gets the refusal at once; whatever else it
gets (no answer yet, another error) is left to `ray.init` to judge, as before, and said in its error should it fail:
a TLS mismatch between this process and the head, too, read to Ray Client as a head that does not answer.
"""

from __future__ import annotations

from typing import Any

from pdserve import env
from pdserve.addresses import split_host_port

CHECK_TIMEOUT_S = 3.0  # a head that answers at all answers in milliseconds; one that does not adds this to a try


class TokenRefused(PermissionError):
    """Ray refused this process's auth token: no later try differs. Not Ray's AuthenticationError, whose text adds
    advice for a local cluster (generate a token) that would mislead here."""


def check_join(address: str) -> str:
    """Ray Client's first call (a GCS client's) to the Ray at `address` (`ray://host:port`, a Ray Client server;
    `host:port`, a GCS; other forms, "auto", are not called): TokenRefused when it refuses this process's token (a
    wrong one, or none sent; the token is never named); else what the call got instead of an answer ("" for one)."""
    import grpc
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray._private.grpc_utils import init_grpc_channel
    from ray.util.client.common import GRPC_OPTIONS

    client = address.startswith("ray://")
    target = address.removeprefix("ray://")
    try:
        split_host_port(target)
    except ValueError:
        return ""
    channel = init_grpc_channel(target, options=GRPC_OPTIONS if client else None, asynchronous=False)
    try:
        _first_call(channel, client)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAUTHENTICATED:
            return _unanswered(e.code().name, e.details() or "")
        server = "its Ray Client server" if client else "its GCS"
        if is_token_auth_enabled():
            why = (
                "this process's token (RAY_AUTH_TOKEN, else RAY_AUTH_TOKEN_PATH's file, else ~/.ray/auth_token) is not "
                "the one the head started with (a head keeps its token until it restarts)"
            )
        else:
            why = "this process sends none (RAY_AUTH_MODE is not token), and the cluster wants one"
        answer = f"{server} answered UNAUTHENTICATED: {e.details()}"
        raise TokenRefused(f"Ray refused the auth token ({answer}): {why}") from None
    finally:
        channel.close()
    return ""


def _unanswered(code: str, details: str) -> str:
    """The call's failure, a TLS mismatch named first (gRPC words it deep in `details`)."""
    if "handshake failed" in details.lower():
        mismatch = (
            "TLS handshake failed (RAY_USE_TLS is on here: is it on the head, with a cert RAY_TLS_CA_CERT signed?)"
        )
    elif "socket closed" in details.lower() and not env.ray_use_tls():
        mismatch = "closed at once (as a head with RAY_USE_TLS on closes a client without it, as here)"
    else:
        mismatch = ""
    answer = f"{code}: {details}"
    return f"{mismatch}: {answer}" if mismatch else answer


def _first_call(channel: Any, client: bool) -> None:
    """What a Ray Client asks first (PING, which the head's proxier answers itself), or a GCS client (the cluster
    id)."""
    if client:
        from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

        ping_type = ray_client_pb2.ClusterInfoType.PING  # type: ignore[attr-defined]  # generated: no stubs
        ping = ray_client_pb2.ClusterInfoRequest(type=ping_type)  # type: ignore[attr-defined]
        ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(ping, timeout=CHECK_TIMEOUT_S)
    else:
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

        gcs = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        gcs.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=CHECK_TIMEOUT_S)  # type: ignore[attr-defined]

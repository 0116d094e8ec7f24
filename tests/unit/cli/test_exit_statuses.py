"""Every command that calls a router exits as a bad flag does, 2, when the router refuses the call as
INVALID_ARGUMENT (the request is wrong: retried as it is, it never works), and 1 when it fails otherwise
(docs/cli.md#exit-status). A real gRPC server on loopback refuses the command's call; any other call the command
makes first (the status `scale` and `drain` read) is answered, empty."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from pdserve.cli import main
from tests.unit.planner.synthetic import synthetic_profile

pytestmark = pytest.mark.timeout(60)
REFUSAL = "refused by the test's router"


class RefusingRouter(grpc.GenericRpcHandler):
    """Refuses `method` (its last path segment) with `code`; answers every other unary call with an empty message."""

    def __init__(self) -> None:
        self.method, self.code = "", grpc.StatusCode.OK

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if details.method.rsplit("/", 1)[-1] != self.method:
            return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")

        def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
            context.abort(self.code, REFUSAL)

        def refuse_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            context.abort(self.code, REFUSAL)
            yield b""  # never reached: a generator, as a server-streaming handler is

        if self.method == "Generate":
            return grpc.unary_stream_rpc_method_handler(refuse_stream)
        return grpc.unary_unary_rpc_method_handler(refuse)


@pytest.fixture(scope="module")
def router() -> Iterator[tuple[str, RefusingRouter]]:
    handler = RefusingRouter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", handler
    finally:
        server.stop(None)


COMMANDS = {  # argv after --addr, and the call whose refusal the command reports
    "client": (["client", "--prompt", "hi"], "Generate"),
    "status": (["status"], "ClusterStatus"),
    "drain": (["drain", "w-1"], "DrainWorkers"),
    "drain --host": (["drain", "--host", "10.0.0.7"], "DrainWorkers"),
    "restart": (["restart", "w-1", "--no-surge"], "DrainWorkers"),
    "scale": (["scale", "--prefill", "2"], "ScaleWorkers"),
    "autoscale --once": (
        ["autoscale", "--once", "--max-workers", "4", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"],
        "ClusterStatus",
    ),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("code", "status"),
    [(grpc.StatusCode.INVALID_ARGUMENT, 2), (grpc.StatusCode.UNAVAILABLE, 1), (grpc.StatusCode.RESOURCE_EXHAUSTED, 1)],
)
def test_a_refused_call_exits_2_when_the_request_is_wrong_else_1(capsys, tmp_path, router, command, code, status):
    address, handler = router
    argv, handler.method = COMMANDS[command]
    handler.code = code
    if argv[0] == "autoscale":
        synthetic_profile().save(Path(tmp_path, "profile.json"))
        argv = [*argv, "--profile", str(tmp_path / "profile.json")]
    assert main([argv[0], "--addr", address, *argv[1:]]) == status
    err = capsys.readouterr().err
    assert f"{code.name}: {REFUSAL}" in err, err

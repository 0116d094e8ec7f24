"""`--priority` goes out with every request, on either protocol, and into the result's config: a run of one class
beside another's is how an SRE checks what priority buys under load."""

from __future__ import annotations

from collections.abc import AsyncIterator

from loadgen import benchmark
from loadgen.__main__ import _bench_parser
from loadgen.benchmark import BenchmarkConfig, make_backend
from loadgen.grpc_backend import GrpcBackend, _stream
from loadgen.openai_backend import OpenAIBackend
from loadgen.record import RequestRecord
from loadgen.workload import Request, WorkloadConfig
from pdserve.flags import from_flags
from pdserve.v1 import generate_pb2 as pb


class Recording:
    """The router's Generate, keeping what it was sent."""

    def __init__(self) -> None:
        self.sent: list[pb.GenerateRequest] = []

    async def Generate(self, msg: pb.GenerateRequest, metadata: tuple) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        self.sent.append(msg)
        yield pb.GenerateResponse(token_ids=[9])


def config_of(*flags: str) -> BenchmarkConfig:
    args = _bench_parser().parse_args(["--addr", "127.0.0.1:1", *flags])
    return from_flags(BenchmarkConfig, args, address="127.0.0.1:1", workload=WorkloadConfig())


def test_the_flag_reaches_both_backends():
    config = config_of("--priority", "5")
    assert config.priority == 5 and config_of().priority == 0
    assert isinstance(grpc := make_backend(config), GrpcBackend) and grpc.priority == 5
    http = benchmark.make_backend(BenchmarkConfig("http://h", WorkloadConfig(), backend="openai", priority=-1))
    assert isinstance(http, OpenAIBackend)
    assert http.payload(Request([5], 2))["priority"] == -1
    assert "priority" not in OpenAIBackend("http://h", "m").payload(Request([5], 2))  # 0: the server's default


async def test_the_grpc_request_carries_it():
    router = Recording()
    await _stream(router, None, 7, (), Request([5, 6], 2), RequestRecord("r", 2, 2, 0.0))  # type: ignore[arg-type]
    assert [m.priority for m in router.sent] == [7]

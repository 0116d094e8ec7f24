"""A real `pdserve up --http-port` (tiny-random) for the modules that test the OpenAI-compatible API, with what
they compare its answers to: the gRPC path's, on the same cluster."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from pdserve.cluster.local_process import ClusterProcess, free_port
from pdserve.engine.models import resolve_model
from pdserve.engine.tokenizer import Tokenizer
from pdserve.rpc.client import StreamResult, generate
from pdserve.v1 import generate_pb2 as pb

MODEL = "tiny-random"
TOKENIZER = Tokenizer(resolve_model(MODEL))
IGNORE_EOS = {"ignore_eos": True}


@contextmanager
def http_cluster(log: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[ClusterProcess]:
    """One prefill and one decode worker; `base_url` is the OpenAI API's, `metrics_url` the router's metrics."""
    http_port, metrics_port = free_port(), free_port()
    args = ["--model", MODEL, "--kv-cache-gb", "0.05", "--prefill", "1", "--decode", "1", *flags]
    args += ["--http-port", str(http_port), "--metrics-port", str(metrics_port)]
    proc = ClusterProcess(*args, log_path=log, env=env)
    proc.base_url = f"http://127.0.0.1:{http_port}/v1"
    proc.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        yield proc
    finally:
        proc.stop()


def openai_client(cluster: ClusterProcess) -> openai.OpenAI:
    """The official client, retrying nothing: a test sees each refusal."""
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=60)


def grpc_result(cluster: ClusterProcess, **fields: object) -> StreamResult:
    """The gRPC path's whole answer to a `GenerateRequest` of these fields."""

    async def run() -> StreamResult:
        result = None
        async for _msg, result in generate(cluster.address, pb.GenerateRequest(**fields), 60):  # noqa: B007
            pass
        assert result is not None
        return result

    return asyncio.run(run())

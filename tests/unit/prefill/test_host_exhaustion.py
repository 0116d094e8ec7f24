"""A prefill worker whose host is out of threads (its KV send's thread does not start: CPython's `RuntimeError: can't
start new thread`), memory or file descriptors answers UNAVAILABLE, which the router retries on another worker and
ejects this one for, not INTERNAL, a bug's code, which reaches the caller as it is and never retried. The servicer,
its engine (tiny-random) and the gRPC server are real; the host's refusal is CPython's own error, raised where a
thread starts."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.errors import UnavailableError
from pdserve.rpc.errors import error_from_rpc
from pdserve.rpc.server import Server, channel
from pdserve.transfer import threads
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from services.prefill.servicer import PrefillServicer
from tests.unit.prefill.traced_worker import traced_worker

pytestmark = pytest.mark.timeout(60)


class Sender:
    """The KV sender, whose thread never starts here."""

    def send(self, *args: object) -> int:
        raise AssertionError("a send ran without a thread")


@contextlib.contextmanager
def host_out_of_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every thread started meanwhile fails as on a host out of them (pthread_create's EAGAIN); the KV transfer pool
    is a new one, with no idle thread to reuse."""
    monkeypatch.setattr(threads, "_POOL", ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-transfer"))

    def refused(*args: object) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(threading, "_start_new_thread", refused)
        yield


async def test_a_kv_send_whose_thread_cannot_start_answers_unavailable_not_a_bug(monkeypatch) -> None:
    worker, engine, _ = traced_worker()
    worker.sender = Sender()  # type: ignore[assignment]
    server = Server("127.0.0.1", 0, reflection=False)
    server.add(lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(worker), s), [])
    await server.start()
    request = worker_pb2.PrefillRequest(
        request_id="r1",
        prompt_token_ids=list(range(3, 11)),
        sampling=generate_pb2.SamplingParams(max_tokens=4),
        target=worker_pb2.KVTarget(decode_worker_id="d0", rendezvous="127.0.0.1:1", block_ids=[0, 1], tag=7),
        layout=worker_pb2.KVLayout(model_fingerprint=engine.fingerprint, block_size=engine.block_size),
        transfer_timeout_ms=5000,
    )
    try:
        async with channel(server.address) as ch:
            call = worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(request, timeout=30)
            with host_out_of_threads(monkeypatch), pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in call:
                    pass
    finally:
        await server.stop(0)
        engine.stop()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    assert "out of threads" in failed.value.details()
    error = error_from_rpc(failed.value, "prefill worker 127.0.0.1:1")
    assert type(error) is UnavailableError  # the router moves the request and ejects the worker
    assert engine.stats["kv_blocks_used"] == 0  # the prompt's blocks freed

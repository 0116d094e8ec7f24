"""The harness of the torch.distributed KV data-plane tests: caches rebuilt from seeds on both sides, a prefill
sender in a spawned process driven over a pipe with JSON commands, recv() in a thread, and the landing check."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdserve.transfer.base import (
    TransferError,
)
from pdserve.transfer.torch_dist import TorchDistReceiver, TorchDistSender

HOST = "127.0.0.1"
FINGERPRINT = "tiny-test-model@1"
NUM_BLOCKS = 24
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_caches(seed: int, dtype: str = "float32", head_dim: int = 8, num_layers: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, 4, 2, head_dim)  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    return [torch.randn(shape, generator=g).to(DTYPES[dtype]) for _ in range(num_layers)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so equality is exact (and NaN-proof) for every dtype."""
    return t.contiguous().view(torch.uint8)


# ----------------------------------------------------------------------------------- the sender process


def _sender_main(conn: Connection, slow_at: int) -> None:
    """Runs JSON commands from the test; `slow_at` >= 0 makes the send of that data message announce itself and
    stall, with the messages before it on the wire; a send command's `stall_s` makes it a silent pause instead."""
    stall = threading.local()  # this thread's send's `stall_s`; None: announce, then never go on
    if slow_at >= 0:
        from pdserve.transfer.pair_group import PairGroup

        original = PairGroup.data_op

        def stalling_data_op(self: Any, send: bool, buf: torch.Tensor, message: int) -> Any:
            if send and message == slow_at:
                if stall.s is not None:
                    time.sleep(stall.s)
                else:
                    conn.send_bytes(json.dumps({"stalled": True}).encode())
                    time.sleep(3600)
            return original(self, send, buf, message)

        PairGroup.data_op = stalling_data_op  # type: ignore[method-assign]

    senders: dict[str, TorchDistSender] = {}

    def sender(fingerprint: str) -> TorchDistSender:
        if fingerprint not in senders:
            senders[fingerprint] = TorchDistSender(HOST, "cpu", fingerprint, connect_timeout_s=10)
        return senders[fingerprint]

    def send(item: dict[str, Any]) -> dict[str, Any]:
        time.sleep(item.get("after_s", 0))  # orders the sends of a "send_many"
        stall.s = item.get("stall_s")
        kv = make_caches(item["seed"], item.get("dtype", "float32"), item.get("head_dim", 8))
        try:
            s = sender(item.get("fingerprint", FINGERPRINT))
            s.secret = item.get("secret", "").encode()  # the receiver's is b"": any other forges the header MAC
            return {"nbytes": s.send(item["rendezvous"], item["tag"], kv, item["ids"], item.get("timeout", 20))}
        except TransferError as e:
            return {"error": type(e).__name__, "message": str(e)}

    while True:
        cmd = json.loads(conn.recv_bytes())
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "connect":  # build the pair group, send nothing
            sender(FINGERPRINT)._pair(cmd["rendezvous"], time.monotonic() + 10)
            reply: Any = {"ok": True}
        elif cmd["op"] == "send":
            reply = send(cmd)
        else:  # "send_many": concurrently, one thread each
            results: list[dict[str, Any]] = [{} for _ in cmd["items"]]

            def run(i: int, item: dict[str, Any], out: list[dict[str, Any]] = results) -> None:
                out[i] = send(item)

            threads = [threading.Thread(target=run, args=(i, it)) for i, it in enumerate(cmd["items"])]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            reply = results
        conn.send_bytes(json.dumps(reply).encode())
    for s in senders.values():
        s.close()


class Peer:
    """A spawned sender process."""

    def __init__(self, slow_at: int = -1) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_sender_main, args=(child, slow_at), daemon=True)
        self.proc.start()

    def call(self, timeout: float = 30, **cmd: Any) -> Any:
        self.conn.send_bytes(json.dumps(cmd).encode())
        return self.reply(timeout)

    def reply(self, timeout: float = 30) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"sender process gave no answer within {timeout} s")
        return json.loads(self.conn.recv_bytes())

    def kill(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send_bytes(json.dumps({"op": "exit"}).encode())
                self.proc.join(10)
            finally:
                if self.proc.is_alive():
                    self.kill()


def _receiver_main(conn: Connection, store_port: int = 0) -> None:
    """Posts a recv per command, each in its own thread (several may wait at once), and answers its byte count."""
    r = TorchDistReceiver(HOST, "cpu", FINGERPRINT, connect_timeout_s=10, store_port=store_port)
    conn.send_bytes(r.rendezvous("prefill-test").encode())
    caches, answering = make_caches(0), threading.Lock()

    def receive(cmd: dict[str, Any]) -> None:
        nbytes = r.recv("prefill-test", cmd["tag"], caches, cmd["ids"], 20)
        with answering:
            conn.send_bytes(json.dumps({"nbytes": nbytes}).encode())

    while True:
        cmd = json.loads(conn.recv_bytes())
        if cmd.get("op") == "rendezvous":  # what a decode worker asks per hand-off
            with answering:
                conn.send_bytes(json.dumps({"rendezvous": r.rendezvous("prefill-test")}).encode())
            continue
        threading.Thread(target=receive, args=(cmd,), daemon=True).start()


class ReceiverProcess:
    """A decode side in its own process, receiving what the test asks for; `kill` is a crash, `stop` a SIGSTOP."""

    def __init__(self, store_port: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_main, args=(child, store_port), daemon=True)
        self.proc.start()
        assert self.conn.poll(30)
        self.rendezvous = self.conn.recv_bytes().decode()

    def expect(self, tag: int, ids: tuple[int, ...] = (0, 1)) -> None:
        self.conn.send_bytes(json.dumps({"tag": tag, "ids": ids}).encode())
        time.sleep(0.2)  # the recv is posted before the send starts

    def received(self) -> int:
        assert self.conn.poll(30)
        return json.loads(self.conn.recv_bytes())["nbytes"]

    def handoff_rendezvous(self) -> str:
        """The address a new hand-off is given (no recv may be answering meanwhile)."""
        self.conn.send_bytes(json.dumps({"op": "rendezvous"}).encode())
        assert self.conn.poll(30)
        return json.loads(self.conn.recv_bytes())["rendezvous"]

    def kill(self) -> None:
        if self.proc.is_alive():
            assert self.proc.pid is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(10)

    def stop(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGCONT)


class Recv:
    """recv() in a thread, so the test can drive the sender meanwhile."""

    def __init__(self, receiver: TorchDistReceiver, peer_id: str, tag: int, kv: list[torch.Tensor], ids: list[int],
                 timeout: float = 20) -> None:  # fmt: skip
        self.result: int | BaseException | None = None
        self.elapsed = 0.0
        self.ended = 0.0  # time.monotonic() when recv returned

        def run() -> None:
            start = time.monotonic()
            try:
                self.result = receiver.recv(peer_id, tag, kv, ids, timeout)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                self.result = e
            self.ended = time.monotonic()
            self.elapsed = self.ended - start

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        time.sleep(0.05)  # registered before the sender starts, as the decode worker does before its RPC

    def join(self, timeout: float = 30) -> int | BaseException | None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "recv did not return"
        return self.result


def assert_only_pair(sender: TorchDistSender, rendezvous: str, within_s: float = 10.0) -> None:
    """The sender keeps a pair with `rendezvous` alone, once its prune of the gone ones (in the background) ran."""
    deadline = time.monotonic() + within_s
    while list(sender._pairs) != [rendezvous] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(sender._pairs) == [rendezvous]


def assert_landed(kv: list[torch.Tensor], before: list[torch.Tensor], src: list[torch.Tensor],
                  src_ids: list[int], dst_ids: list[int]) -> None:  # fmt: skip
    others = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    for layer, (got, old, want) in enumerate(zip(kv, before, src, strict=True)):
        assert torch.equal(bits(got[:, dst_ids]), bits(want[:, src_ids])), f"layer {layer}: blocks differ"
        assert torch.equal(bits(got[:, others]), bits(old[:, others])), f"layer {layer}: other blocks changed"


# --------------------------------------------------------------------------------------------- transfers

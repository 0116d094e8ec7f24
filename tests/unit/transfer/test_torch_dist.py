"""The torch.distributed KV data plane between real processes (spawned), over gloo on loopback.

The test process is the decode side (one TorchDistReceiver for the module); prefill senders run in spawned
processes driven over a pipe with JSON commands. Caches are rebuilt from seeds on both sides, so the expected
blocks never travel through the harness.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from pdserve.transfer.base import (
    LayoutMismatchError,
    PeerLostError,
    TransferCancelledError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.torch_dist import TorchDistReceiver, TorchDistSender

pytestmark = pytest.mark.timeout(120)  # a hang fails the test instead of the whole run

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
    stall, with the messages before it on the wire."""
    if slow_at >= 0:
        from pdserve.transfer.pair_group import PairGroup

        original = PairGroup.data_op

        def stalling_data_op(self: Any, send: bool, buf: torch.Tensor, message: int) -> Any:
            if send and message == slow_at:
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


@pytest.fixture(scope="module")
def receiver() -> Iterator[TorchDistReceiver]:
    r = TorchDistReceiver(HOST, "cpu", FINGERPRINT, connect_timeout_s=10)
    yield r
    r.close()


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.close()


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


def assert_landed(kv: list[torch.Tensor], before: list[torch.Tensor], src: list[torch.Tensor],
                  src_ids: list[int], dst_ids: list[int]) -> None:  # fmt: skip
    others = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    for layer, (got, old, want) in enumerate(zip(kv, before, src, strict=True)):
        assert torch.equal(bits(got[:, dst_ids]), bits(want[:, src_ids])), f"layer {layer}: blocks differ"
        assert torch.equal(bits(got[:, others]), bits(old[:, others])), f"layer {layer}: other blocks changed"


# --------------------------------------------------------------------------------------------- transfers


IDS = {  # (src ids, dst ids); the sender sends a message per run of its ids (4 at most, else one message)
    "runs": (list(range(4, 13)), list(range(10, 19))),  # one run each side: no copy on either
    "scattered": ([9, 2, 17, 5], [3, 20, 7, 14]),  # single blocks: no copy either
    "mixed": ([4, 5, 6, 7, 15, 16, 2], [3, 20, 7, 8, 1, 2, 12]),  # a sender run lands on scattered blocks
    "many-runs": (list(range(23, 5, -1)), list(range(9)) + [12, 14, 16] + list(range(18, 24))),  # gathered
}


@pytest.mark.parametrize("ids", list(IDS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_land_bit_exact(receiver: TorchDistReceiver, peer: Peer, dtype: str, ids: str) -> None:
    src_ids, dst_ids = IDS[ids]
    tag = {"float32": 10, "bfloat16": 20}[dtype] + list(IDS).index(ids)
    kv = make_caches(100 + tag, dtype)  # the decode side's own content, which must survive outside dst_ids
    before = [t.clone() for t in kv]
    rendezvous = receiver.rendezvous("prefill-0")
    r = Recv(receiver, "prefill-0", tag, kv, dst_ids)
    sent = peer.call(op="send", rendezvous=rendezvous, tag=tag, seed=tag, dtype=dtype, ids=src_ids)
    got = r.join()
    expected = KVLayout.from_caches(kv, FINGERPRINT).bytes_for(len(dst_ids))
    assert sent == {"nbytes": expected}
    assert got == expected
    assert_landed(kv, before, make_caches(tag, dtype), src_ids, dst_ids)


def test_concurrent_transfers_over_one_pair_and_several_peers(receiver: TorchDistReceiver, peer: Peer) -> None:
    jobs = [  # (peer id, tag, src ids, dst ids): two share the pair of prefill-0, one goes over prefill-1
        ("prefill-0", 31, [1, 3, 5, 7], [0, 2, 4, 6]),
        ("prefill-0", 32, [20, 21, 22, 8, 9], [13, 19, 8, 9, 10]),
        ("prefill-1", 33, [0, 1, 2], [21, 22, 23]),
    ]
    kv = make_caches(7, "bfloat16")
    before = [t.clone() for t in kv]
    items = [
        {"rendezvous": receiver.rendezvous(p), "tag": tag, "seed": 1000 + tag, "dtype": "bfloat16", "ids": src}
        for p, tag, src, _ in jobs
    ]
    recvs = [Recv(receiver, p, tag, kv, dst) for p, tag, _, dst in jobs]
    replies = peer.call(op="send_many", items=items)
    for (_, tag, src, _dst), reply, r in zip(jobs, replies, recvs, strict=True):
        assert reply == {"nbytes": KVLayout.from_caches(kv, FINGERPRINT).bytes_for(len(src))}, tag
        assert isinstance(r.join(), int), r.result
    for _, tag, src, dst in jobs:
        want = make_caches(1000 + tag, "bfloat16")
        for layer in range(len(kv)):
            assert torch.equal(bits(kv[layer][:, dst]), bits(want[layer][:, src])), (tag, layer)
    untouched = [b for b in range(NUM_BLOCKS) if all(b not in dst for *_, dst in jobs)]
    for layer in range(len(kv)):
        assert torch.equal(bits(kv[layer][:, untouched]), bits(before[layer][:, untouched]))


def test_layout_mismatch_fails_both_sides_naming_the_field(receiver: TorchDistReceiver, peer: Peer) -> None:
    rendezvous = receiver.rendezvous("prefill-0")
    kv = make_caches(3)
    before = [t.clone() for t in kv]
    # The other model's sender is another process's: its own pair, under another peer id.
    cases = [("prefill-0", {"head_dim": 16}, "head_dim"), ("prefill-9", {"fingerprint": "other"}, "model_fingerprint")]
    for i, (peer_id, change, field) in enumerate(cases):
        address = receiver.rendezvous(peer_id)
        r = Recv(receiver, peer_id, 40 + i, kv, [1, 2])
        reply = peer.call(op="send", rendezvous=address, tag=40 + i, seed=5, ids=[3, 4], **change)
        err = r.join()
        assert isinstance(err, LayoutMismatchError) and field in str(err), err
        assert reply["error"] == "LayoutMismatchError" and field in reply["message"], reply
    for got, old in zip(kv, before, strict=True):
        assert torch.equal(bits(got), bits(old))
    # A wrong block count is refused too, and the pair still carries the next transfer.
    r = Recv(receiver, "prefill-0", 42, kv, [1, 2, 3])
    reply = peer.call(op="send", rendezvous=rendezvous, tag=42, seed=5, ids=[3, 4])
    assert isinstance(r.join(), TransferError) and reply["error"] == "TransferError"
    r = Recv(receiver, "prefill-0", 43, kv, [1, 2])
    assert peer.call(op="send", rendezvous=rendezvous, tag=43, seed=5, ids=[3, 4]) == {"nbytes": r.join()}


def test_a_forged_header_is_refused_and_the_real_transfer_still_lands(receiver: TorchDistReceiver, peer: Peer) -> None:
    """A sender without the cluster secret aims at a pending recv's tag: refused (FORGED) and drained, nothing
    written; the recv keeps waiting and takes the real transfer, bit exact."""
    rendezvous = receiver.rendezvous("prefill-0")
    kv = make_caches(77)
    before = [t.clone() for t in kv]
    r = Recv(receiver, "prefill-0", 44, kv, [5, 6, 7])
    forged = peer.call(op="send", rendezvous=rendezvous, tag=44, seed=666, ids=[1, 2, 3], secret="not-the-secret")
    assert forged["error"] == "TransferError" and "MAC" in forged["message"], forged
    assert r.thread.is_alive()  # still waiting for the real one
    for got, old in zip(kv, before, strict=True):
        assert torch.equal(bits(got), bits(old))
    sent = peer.call(op="send", rendezvous=rendezvous, tag=44, seed=44, ids=[1, 2, 3])
    assert sent == {"nbytes": r.join()}
    assert_landed(kv, before, make_caches(44), [1, 2, 3], [5, 6, 7])


def test_silent_sender_times_out_and_leaves_the_pair_usable(receiver: TorchDistReceiver, peer: Peer) -> None:
    rendezvous = receiver.rendezvous("prefill-0")
    peer.call(op="connect", rendezvous=rendezvous)
    kv = make_caches(4)
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="tag 50"):
        receiver.recv("prefill-0", 50, kv, [0, 1], timeout_s=1.5)
    assert 1.4 <= time.monotonic() - start < 4
    # The sender turns up late with the abandoned tag: refused at once, not after its own timeout.
    start = time.monotonic()
    reply = peer.call(op="send", rendezvous=rendezvous, tag=50, seed=1, ids=[0, 1], timeout=20)
    assert reply["error"] == "TransferError" and "no recv is waiting" in reply["message"], reply
    assert time.monotonic() - start < 5
    r = Recv(receiver, "prefill-0", 51, kv, [0, 1])
    assert peer.call(op="send", rendezvous=rendezvous, tag=51, seed=1, ids=[0, 1]) == {"nbytes": r.join()}


def test_cancelled_recv_ends_at_once_and_the_pair_stays_usable(receiver: TorchDistReceiver, peer: Peer) -> None:
    """A request cancelled while its recv waits for a stalled sender frees its blocks now, not at the timeout."""
    rendezvous = receiver.rendezvous("prefill-0")
    peer.call(op="connect", rendezvous=rendezvous)
    kv = make_caches(4)
    before = [t.clone() for t in kv]
    r = Recv(receiver, "prefill-0", 52, kv, [0, 1], timeout=20)
    receiver.cancel("prefill-0", 52)
    assert isinstance(r.join(timeout=5), TransferCancelledError), r.result
    assert r.elapsed < 2
    # Cancelled before it was posted (the caller left first): it never waits.
    receiver.cancel("prefill-0", 53)
    with pytest.raises(TransferCancelledError):
        receiver.recv("prefill-0", 53, kv, [0, 1], timeout_s=20)
    # The sender turns up late with the cancelled tag: refused, and nothing written.
    reply = peer.call(op="send", rendezvous=rendezvous, tag=52, seed=1, ids=[0, 1], timeout=20)
    assert reply["error"] == "TransferError" and "no recv is waiting" in reply["message"], reply
    for got, old in zip(kv, before, strict=True):
        assert torch.equal(bits(got), bits(old))
    r = Recv(receiver, "prefill-0", 54, kv, [0, 1])
    assert peer.call(op="send", rendezvous=rendezvous, tag=54, seed=1, ids=[0, 1]) == {"nbytes": r.join()}


def test_sender_that_never_connects_times_out(receiver: TorchDistReceiver) -> None:
    receiver.rendezvous("prefill-never")
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError):
        receiver.recv("prefill-never", 1, make_caches(4), [0], timeout_s=1.0)
    assert 0.9 <= time.monotonic() - start < 3


def test_recv_needs_a_rendezvous_and_rejects_bad_ids(receiver: TorchDistReceiver) -> None:
    kv = make_caches(4)
    with pytest.raises(TransferError, match="rendezvous"):
        receiver.recv("prefill-unknown", 1, kv, [0], timeout_s=1)
    receiver.rendezvous("prefill-ids")
    with pytest.raises(ValueError, match="distinct"):
        receiver.recv("prefill-ids", 1, kv, [2, 2], timeout_s=1)
    with pytest.raises(ValueError, match="lie in"):
        receiver.recv("prefill-ids", 1, kv, [NUM_BLOCKS], timeout_s=1)
    assert receiver.recv("prefill-ids", 1, kv, [], timeout_s=1) == 0


@pytest.mark.parametrize("when", ["before sending", "mid-transfer"])
def test_killed_sender_fails_recv_at_once_and_a_new_sender_works(
    receiver: TorchDistReceiver, peer: Peer, when: str
) -> None:
    peer_id = f"prefill-victim-{when.split()[0]}"
    rendezvous = receiver.rendezvous(peer_id)
    kv = make_caches(6)
    before = [t.clone() for t in kv]
    dst_ids = [5, 9, 2]
    victim = Peer(slow_at=3 if when == "mid-transfer" else -1)
    try:
        if when == "before sending":
            victim.call(op="connect", rendezvous=rendezvous)
            r = Recv(receiver, peer_id, 60, kv, dst_ids, timeout=30)
        else:
            r = Recv(receiver, peer_id, 60, kv, dst_ids, timeout=30)
            victim.conn.send_bytes(json.dumps({"op": "send", "rendezvous": rendezvous, "tag": 60, "seed": 2,
                                               "ids": [1, 8, 3]}).encode())  # fmt: skip
            assert victim.reply() == {"stalled": True}  # three of its 18 messages are on the wire
        killed = time.monotonic()
        victim.kill()
        err = r.join(timeout=10)
    finally:
        victim.close()
    assert isinstance(err, PeerLostError), err
    noticed = r.ended - killed
    assert noticed < 3, f"recv took {noticed:.1f} s to notice the dead sender (timeout 30 s)"
    others = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    for got, old in zip(kv, before, strict=True):
        assert torch.equal(bits(got[:, others]), bits(old[:, others]))
    with pytest.raises(PeerLostError):  # until the next rendezvous, the peer stays lost
        receiver.recv(peer_id, 61, kv, dst_ids, timeout_s=5)
    new_rendezvous = receiver.rendezvous(peer_id)
    assert new_rendezvous != rendezvous
    r = Recv(receiver, peer_id, 62, kv, dst_ids)
    assert peer.call(op="send", rendezvous=new_rendezvous, tag=62, seed=3, ids=[0, 4, 7]) == {"nbytes": r.join()}
    assert_landed(kv, before, make_caches(3), [0, 4, 7], dst_ids)


def test_sender_stalled_mid_transfer_times_out_and_drops_the_pair(receiver: TorchDistReceiver, peer: Peer) -> None:
    rendezvous = receiver.rendezvous("prefill-stalled")
    kv = make_caches(6)
    victim = Peer(slow_at=2)
    try:
        victim.conn.send_bytes(json.dumps({"op": "send", "rendezvous": rendezvous, "tag": 70, "seed": 2,
                                           "ids": [1, 8, 3]}).encode())  # fmt: skip
        # Registered only once the sender is up and stalled, so the clock measures the stall alone.
        assert victim.reply() == {"stalled": True}
        start = time.monotonic()
        with pytest.raises(TransferTimeoutError):
            receiver.recv("prefill-stalled", 70, kv, [5, 9, 2], timeout_s=1.5)
        assert 1.4 <= time.monotonic() - start < 4
    finally:
        victim.kill()  # it sleeps in the stalled send
    new_rendezvous = receiver.rendezvous("prefill-stalled")
    assert new_rendezvous != rendezvous  # a wait that timed out closed the gloo pair: a new one is built
    r = Recv(receiver, "prefill-stalled", 71, kv, [5, 9, 2])
    assert peer.call(op="send", rendezvous=new_rendezvous, tag=71, seed=3, ids=[0, 4, 7]) == {"nbytes": r.join()}


def _receiver_main(conn: Connection) -> None:
    r = TorchDistReceiver(HOST, "cpu", FINGERPRINT, connect_timeout_s=10)
    conn.send_bytes(r.rendezvous("prefill-test").encode())
    while True:
        cmd = json.loads(conn.recv_bytes())
        nbytes = r.recv("prefill-test", cmd["tag"], make_caches(0), cmd["ids"], 20)
        conn.send_bytes(json.dumps({"nbytes": nbytes}).encode())


def test_killed_receiver_fails_send_at_once() -> None:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child,), daemon=True)
    proc.start()
    s = TorchDistSender(HOST, "cpu", FINGERPRINT, connect_timeout_s=10)
    try:
        assert conn.poll(30)
        rendezvous = conn.recv_bytes().decode()
        kv = make_caches(8)
        conn.send_bytes(json.dumps({"tag": 1, "ids": [0, 1]}).encode())
        assert s.send(rendezvous, 1, kv, [2, 3], 10) == json.loads(conn.recv_bytes())["nbytes"]
        conn.send_bytes(json.dumps({"tag": 2, "ids": [0, 1]}).encode())
        time.sleep(0.2)
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        start = time.monotonic()
        with pytest.raises(PeerLostError):
            s.send(rendezvous, 2, kv, [2, 3], 30)
        assert time.monotonic() - start < 5
    finally:
        s.close()
        if proc.is_alive():
            proc.kill()

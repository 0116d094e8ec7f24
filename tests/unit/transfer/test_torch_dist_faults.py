"""The torch.distributed KV data plane between real processes (spawned), over gloo on loopback:
a silent, stalled, cancelled or killed peer fails the transfer in time and leaves the pair usable.

The test process is the decode side (one TorchDistReceiver per module); prefill senders run in spawned processes
(pair_harness.py). Caches are rebuilt from seeds on both sides, so the expected blocks never travel through the
harness.
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
import weakref

import pytest
import torch

from pdserve.cluster.local_process import free_port
from pdserve.transfer import torch_dist
from pdserve.transfer.base import (
    PeerLostError,
    TransferCancelledError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.transfer.torch_dist import TorchDistReceiver, TorchDistSender
from tests.unit.transfer.pair_harness import (
    FINGERPRINT,
    HOST,
    NUM_BLOCKS,
    Peer,
    ReceiverProcess,
    Recv,
    assert_landed,
    assert_only_pair,
    bits,
    make_caches,
)

pytestmark = pytest.mark.timeout(120)  # a hang fails the test instead of the whole run


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
    assert reply["error"] == "NotExpectedError" and "no recv is waiting" in reply["message"], reply
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
    assert reply["error"] == "NotExpectedError" and "no recv is waiting" in reply["message"], reply
    for got, old in zip(kv, before, strict=True):
        assert torch.equal(bits(got), bits(old))
    r = Recv(receiver, "prefill-0", 54, kv, [0, 1])
    assert peer.call(op="send", rendezvous=rendezvous, tag=54, seed=1, ids=[0, 1]) == {"nbytes": r.join()}


def test_a_transfer_whose_recv_was_cancelled_before_it_was_posted_is_refused_at_once(
    receiver: TorchDistReceiver, peer: Peer
) -> None:
    """The decode request was cancelled between calling the prefill worker and posting its recv: the sender's
    transfer for that tag is refused at once, whether its header comes after the cancel or is already waiting
    for the recv (waiting half its timeout would hold every transfer of the pair behind it)."""
    rendezvous = receiver.rendezvous("prefill-0")
    peer.call(op="connect", rendezvous=rendezvous)
    receiver.cancel("prefill-0", 55)
    start = time.monotonic()
    reply = peer.call(op="send", rendezvous=rendezvous, tag=55, seed=1, ids=[0, 1], timeout=20)
    assert reply["error"] == "NotExpectedError" and "no recv is waiting" in reply["message"], reply
    assert time.monotonic() - start < 3
    send_56 = {"op": "send", "rendezvous": rendezvous, "tag": 56, "seed": 1, "ids": [0, 1], "timeout": 20}
    peer.conn.send_bytes(json.dumps(send_56).encode())  # answered below
    time.sleep(1)  # its header is in: the serving thread waits for tag 56's recv
    start = time.monotonic()
    receiver.cancel("prefill-0", 56)
    reply = peer.reply()
    assert reply["error"] == "NotExpectedError" and "no recv is waiting" in reply["message"], reply
    assert time.monotonic() - start < 3
    kv = make_caches(4)
    r = Recv(receiver, "prefill-0", 57, kv, [0, 1])
    assert peer.call(op="send", rendezvous=rendezvous, tag=57, seed=1, ids=[0, 1]) == {"nbytes": r.join()}


def test_sender_that_never_connects_times_out(receiver: TorchDistReceiver) -> None:
    receiver.rendezvous("prefill-never")
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError):
        receiver.recv("prefill-never", 1, make_caches(4), [0], timeout_s=1.0)
    assert 0.9 <= time.monotonic() - start < 3


def test_a_pair_no_sender_claims_is_dropped_with_its_port_and_thread_and_comes_back_on_rendezvous() -> None:
    """Each hand-off to a prefill worker that died before sending opened a pair on the decode side: kept for ever,
    each held a port of the worker's fixed span and a thread. Unclaimed past the bound (and no recv waiting), it
    goes; a later rendezvous opens a fresh one on the freed port."""
    r = TorchDistReceiver(HOST, "cpu", FINGERPRINT, connect_timeout_s=10, store_port=free_port())
    r.unclaimed_pair_s = 0.5
    try:
        gone = r.rendezvous("prefill-gone")

        def serving() -> bool:
            return any(t.name == "kv-recv-prefill-gone" for t in threading.enumerate())

        outcome: list[BaseException] = []

        def wait() -> None:
            """Its error is the main thread's to check: pytest.raises failing in a thread only warns."""
            try:
                r.recv("prefill-gone", 1, make_caches(4), [0], timeout_s=2.0)
            except TransferError as e:
                outcome.append(e)

        waiting = threading.Thread(target=wait)
        waiting.start()
        time.sleep(1.0)
        assert serving()  # past the bound, but a recv waits on it
        waiting.join()
        assert [type(e) for e in outcome] == [TransferTimeoutError], outcome  # its own timeout, not the pair's drop
        end = time.monotonic() + 10
        while serving():
            assert time.monotonic() < end, "the unclaimed pair's thread still runs"
            time.sleep(0.05)
        with pytest.raises(PeerLostError, match="no sender claimed the pair"):
            r.recv("prefill-gone", 2, make_caches(4), [0], timeout_s=1.0)
        assert r.rendezvous("prefill-other") == gone  # the port is free again
        assert r.rendezvous("prefill-gone") != gone  # a fresh pair, on the next port
    finally:
        r.close()


def test_the_receiver_remembers_only_the_latest_lost_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill workers leave for good (ids are never reused): why each one's pair died is kept for a late recv, but
    only for the latest `_MAX_LOST` peers, not one entry per peer ever lost."""
    monkeypatch.setattr(torch_dist, "_MAX_LOST", 2)
    r = TorchDistReceiver(HOST, "cpu", FINGERPRINT, connect_timeout_s=10, store_port=free_port())
    r.unclaimed_pair_s = 0.3
    try:
        peers = [f"prefill-gone-{i}" for i in range(3)]
        for peer_id in peers:
            r.rendezvous(peer_id)
        end = time.monotonic() + 10
        while any(t.name.startswith("kv-recv-prefill-gone") for t in threading.enumerate()):
            assert time.monotonic() < end, "the unclaimed pairs' threads still run"
            time.sleep(0.05)
        lost = {}
        for peer_id in peers:
            with pytest.raises(TransferError) as e:
                r.recv(peer_id, 1, make_caches(4), [0], timeout_s=1.0)
            lost[peer_id] = isinstance(e.value, PeerLostError)
        assert sum(lost.values()) == 2, lost  # two remembered as lost; the oldest forgotten ("call rendezvous()")
    finally:
        r.close()


def test_a_rendezvous_at_the_moment_an_unclaimed_pair_is_given_up_keeps_it() -> None:
    """The serving thread gives a pair up only under the lock a rendezvous takes: one that refreshed the pair while
    the thread waited for that lock keeps it (its hand-off's sender will come), and it goes once unclaimed again."""
    r = TorchDistReceiver(HOST, "cpu", FINGERPRINT, connect_timeout_s=10, store_port=free_port())
    r.unclaimed_pair_s = 1.0
    try:
        r.rendezvous("prefill-racing")
        pair = r._pairs["prefill-racing"]
        with r._lock:  # as a rendezvous holds it
            time.sleep(2.0)  # the serving thread found the pair unclaimed and waits for the lock
            pair.last_rendezvous = time.monotonic()  # what that rendezvous does before it lets go
        time.sleep(0.3)  # the serving thread has the lock now, and must not drop a pair refreshed under it
        assert r._pairs.get("prefill-racing") is pair and pair.error is None
        end = time.monotonic() + 10
        while "prefill-racing" in r._pairs:  # a second past the refresh, unclaimed: dropped
            assert time.monotonic() < end
            time.sleep(0.05)
    finally:
        r.close()


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


def test_killed_receiver_fails_send_at_once() -> None:
    receiver = ReceiverProcess()
    s = TorchDistSender(HOST, "cpu", FINGERPRINT, connect_timeout_s=10)
    try:
        kv = make_caches(8)
        receiver.expect(1)
        assert s.send(receiver.rendezvous, 1, kv, [2, 3], 10) == receiver.received()
        receiver.expect(2)
        receiver.kill()
        start = time.monotonic()
        with pytest.raises(PeerLostError):
            s.send(receiver.rendezvous, 2, kv, [2, 3], 30)
        assert time.monotonic() - start < 5
    finally:
        s.close()
        receiver.kill()


def test_a_pair_dropped_for_a_dead_receiver_goes_with_its_gloo_group_at_once() -> None:
    """The liveness check's failure, kept on the pair for the next check, held check_peer's frame and so the pair
    itself: a cycle through an old object, which only a full collection (rare in a long-lived worker) frees, and
    until then the dead pair's gloo group kept its thread and sockets."""
    receiver = ReceiverProcess()
    s = TorchDistSender(HOST, "cpu", FINGERPRINT, connect_timeout_s=10)
    gc.disable()
    try:
        kv = make_caches(8)
        receiver.expect(1)
        assert s.send(receiver.rendezvous, 1, kv, [2, 3], 10) == receiver.received()
        gc.collect()  # the pair is old now, as a worker's pairs are
        dropped = weakref.ref(s._pairs[receiver.rendezvous])
        receiver.kill()
        lost = False
        try:
            s.send(receiver.rendezvous, 2, kv, [2, 3], 10)
        except PeerLostError:
            lost = True
        assert lost
        gc.collect(1)  # the young generations only
        assert dropped() is None
    finally:
        gc.enable()
        s.close()
        receiver.kill()


def test_a_receiver_restarted_at_its_address_takes_the_next_send_and_dead_receivers_pairs_go() -> None:
    """A decode worker restarted on its fixed transfer port: the prefill side's pair with the dead process fails
    its liveness check, and the send connects to the new one instead of failing. A decode worker restarted at
    another address: the dead one's pair is dropped once the new pair connects."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    s = TorchDistSender(HOST, "cpu", FINGERPRINT, connect_timeout_s=10)
    kv = make_caches(8)
    receivers = [ReceiverProcess(port)]
    try:
        receivers[0].expect(1)
        assert s.send(receivers[0].rendezvous, 1, kv, [2, 3], 10) == receivers[0].received()
        receivers[0].kill()

        receivers.append(ReceiverProcess(port))
        assert receivers[1].rendezvous == receivers[0].rendezvous  # its port back at once
        receivers[1].expect(2, (0, 1))
        receivers[1].expect(4, (2, 3))
        sent: list[int | BaseException] = []

        def send(tag: int) -> None:
            try:
                sent.append(s.send(receivers[1].rendezvous, tag, kv, [2, 3], 10))
            except BaseException as e:
                sent.append(e)

        dead = s._pairs[receivers[1].rendezvous]
        with dead.lock:  # both sends take the dead pair and wait for it: one drops it while the other waits
            threads = [threading.Thread(target=send, args=(tag,)) for tag in (2, 4)]
            for t in threads:
                t.start()
            time.sleep(0.2)
        for t in threads:
            t.join(30)
        assert len(sent) == 2 and all(isinstance(n, int) for n in sent), sent
        assert sorted(sent) == sorted(receivers[1].received() for _ in range(2))  # type: ignore[type-var]
        receivers[1].kill()

        receivers.append(ReceiverProcess())
        assert receivers[2].rendezvous != receivers[1].rendezvous
        receivers[2].expect(3)
        assert s.send(receivers[2].rendezvous, 3, kv, [2, 3], 10) == receivers[2].received()
        assert_only_pair(s, receivers[2].rendezvous)
    finally:
        s.close()
        for receiver in receivers:
            receiver.kill()

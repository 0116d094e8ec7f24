"""A decode process that is stopped (SIGSTOP, or hung) still has its kernel accept connections and take requests:
a prefill worker's send to it must fail by its deadline, on its first send (the store's connect) and on a pair
that served before (its liveness check), not wait as long as the stop lasts while it holds the prompt's KV; and
once it resumes, the sends pair with it again."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch

from pdserve.transfer.base import TransferCancelledError, TransferError, TransferTimeoutError
from pdserve.transfer.rendezvous import claim_store, device_info
from pdserve.transfer.send_start import SendStart
from pdserve.transfer.torch_dist import TorchDistReceiver, TorchDistSender
from tests.unit.transfer.pair_harness import FINGERPRINT, HOST, ReceiverProcess, make_caches

pytestmark = pytest.mark.timeout(60)
SEND_TIMEOUT_S = 4.0  # past the liveness check's 2 s: what is left is the claim's


def _send(
    sender: TorchDistSender,
    rendezvous: str,
    tag: int,
    outcome: Future[int],
    timeout_s: float = SEND_TIMEOUT_S,
    start: SendStart | None = None,
) -> None:
    try:
        outcome.set_result(sender.send(rendezvous, tag, make_caches(1), [0, 1], timeout_s, start))
    except BaseException as e:
        outcome.set_exception(e)


@contextlib.contextmanager
def a_paired_receiver_stopped() -> Iterator[tuple[TorchDistSender, ReceiverProcess]]:
    """A pair that served one hand-off (tag 1), its decode process then stopped; the test resumes it. Checks, after
    the test, that the pair serves the next hand-off (tag 3)."""
    receiver = ReceiverProcess()
    sender = TorchDistSender(HOST, "cpu", FINGERPRINT, connect_timeout_s=10)
    try:
        receiver.expect(1)
        assert sender.send(receiver.rendezvous, 1, make_caches(1), [0, 1], 10) == receiver.received()
        receiver.stop()
        yield sender, receiver
        receiver.expect(3)
        assert sender.send(receiver.rendezvous, 3, make_caches(1), [0, 1], 10) == receiver.received()
    finally:
        sender.close()
        receiver.kill()


def test_a_first_send_to_a_stopped_receiver_fails_by_its_deadline() -> None:
    receiver = ReceiverProcess()
    sender = TorchDistSender(HOST, "cpu", FINGERPRINT, connect_timeout_s=10)
    rendezvous = receiver.rendezvous
    try:
        receiver.stop()
        start, outcome = time.monotonic(), Future()
        sending = threading.Thread(target=_send, args=(sender, rendezvous, 2, outcome), daemon=True)
        sending.start()  # on a thread: a send that hangs (in C++, deaf to pytest's timeout) fails the test instead
        sending.join(15)
        assert not sending.is_alive(), "the send to a stopped receiver is still waiting after 15 s"
        with pytest.raises(TransferTimeoutError, match="no answer from the rendezvous store"):
            outcome.result()
        assert time.monotonic() - start < SEND_TIMEOUT_S + 2
        again = time.monotonic()  # the claim given up on is still unanswered: another fails at once, no new thread
        with pytest.raises(TransferTimeoutError, match="still unanswered"):
            sender.send(rendezvous, 3, make_caches(1), [0, 1], SEND_TIMEOUT_S)
        assert time.monotonic() - again < SEND_TIMEOUT_S / 2  # not its deadline: at once
        receiver.resume()  # the claim given up on is answered late, and claims nothing
        resumed = time.monotonic()
        while True:
            try:
                sender.send(rendezvous, 4, make_caches(1), [0, 1], SEND_TIMEOUT_S)
            except TransferError as e:
                if "still unanswered" in str(e) and time.monotonic() - resumed < 10:
                    time.sleep(0.1)
                    continue
                assert "no recv is waiting" in str(e), e  # a pair that works: the receiver expects no tag 4
                break
    finally:
        sender.close()
        receiver.kill()  # its store's connections reset: the calls' threads end


def test_a_paired_receiver_stopped_fails_sends_past_their_deadline_and_keeps_its_pair_for_when_it_resumes() -> None:
    """A send on a pair that served waits for its stopped decode process within its deadline (one liveness round
    trip, shared by the sends that queue behind it), then times out; the pair stays, and serves once it resumes."""
    with a_paired_receiver_stopped() as (sender, receiver):
        start, outcome = time.monotonic(), Future()
        sending = threading.Thread(target=_send, args=(sender, receiver.rendezvous, 2, outcome), daemon=True)
        sending.start()
        sending.join(15)
        assert not sending.is_alive(), "the send to a stopped receiver is still waiting after 15 s"
        with pytest.raises(TransferTimeoutError, match="not answering"):
            outcome.result()
        assert time.monotonic() - start < SEND_TIMEOUT_S + 2
        receiver.resume()


def test_a_send_called_off_while_its_receiver_is_stopped_never_reads_the_blocks_and_the_pair_serves_on() -> None:
    """The prefill worker's caller left while the send waits for its stopped decode process (the pair's liveness
    check): called off, the send must never start its transfer, so the caller frees the blocks at once. Once the
    process resumes, the send raises TransferCancelledError (before, it sent the blocks, long freed by then), and
    the pair serves the next hand-off."""
    with a_paired_receiver_stopped() as (sender, receiver):
        start, outcome = SendStart(), Future()
        sending = threading.Thread(
            target=_send, args=(sender, receiver.rendezvous, 2, outcome, 10.0, start), daemon=True
        )
        sending.start()
        time.sleep(0.5)  # it waits for the stopped process's answer
        assert start.call_off()
        receiver.resume()
        sending.join(5)
        assert not sending.is_alive(), "the send called off still waits 5 s after its receiver resumed"
        with pytest.raises(TransferCancelledError):
            outcome.result()


def test_a_send_whose_transfer_began_cannot_be_called_off() -> None:
    start = SendStart()
    start.begin()
    assert not start.call_off()  # its blocks are in use until it ends
    start.begin()  # a send that was not called off goes on


def test_hand_offs_sent_while_their_receiver_pauses_are_received_once_it_resumes() -> None:
    """The decode process pauses 3 s (a loaded host, a long GC, SIGSTOP) while hand-offs queue for it, each with a
    10 s deadline. Before, the first send's liveness check timed out after 2 s and dropped the pair, the store
    refused the sender's claim once the process resumed (one sender per store), and all three were lost."""
    receiver = ReceiverProcess()
    sender = TorchDistSender(HOST, "cpu", FINGERPRINT, connect_timeout_s=10)
    try:
        receiver.expect(1)
        assert sender.send(receiver.rendezvous, 1, make_caches(1), [0, 1], 10) == receiver.received()
        for tag in (2, 3, 4):
            receiver.expect(tag, (2 * tag, 2 * tag + 1))
        receiver.stop()
        threading.Timer(3.0, receiver.resume).start()
        outcomes: dict[int, Future[int]] = {tag: Future() for tag in (2, 3, 4)}
        sends = [
            threading.Thread(target=_send, args=(sender, receiver.rendezvous, tag, f, 10.0), daemon=True)
            for tag, f in outcomes.items()
        ]
        for thread in sends:
            thread.start()
            time.sleep(0.3)
        for thread in sends:
            thread.join(30)
        sent = sorted(f.result() for f in outcomes.values())  # raises the first send that failed
        assert sent == sorted(receiver.received() for _ in outcomes)
    finally:
        sender.close()
        receiver.kill()


def test_a_new_decode_workers_pair_does_not_prune_the_pair_of_one_paused_meanwhile() -> None:
    """Connecting a pair sets off a prune of the pairs whose decode process is gone. One paused then (its liveness
    check unanswered for 2 s) was pruned too, and once it resumed its store refused the sender's new claim: every
    hand-off to it failed, as when a send's own check dropped it."""
    receiver, newcomer = ReceiverProcess(), ReceiverProcess()
    sender = TorchDistSender(HOST, "cpu", FINGERPRINT, connect_timeout_s=10)
    try:
        receiver.expect(1)
        assert sender.send(receiver.rendezvous, 1, make_caches(1), [0, 1], 10) == receiver.received()
        receiver.stop()
        newcomer.expect(1)
        assert sender.send(newcomer.rendezvous, 1, make_caches(1), [0, 1], 10) == newcomer.received()
        end = time.monotonic() + 15
        while any(t.name == "kv-send-prune" for t in threading.enumerate()):  # its check of the paused one: 2 s
            assert time.monotonic() < end, "the prune never ended"
            time.sleep(0.1)
        receiver.resume()
        receiver.expect(2)
        assert sender.send(receiver.rendezvous, 2, make_caches(1), [0, 1], 10) == receiver.received()
    finally:
        sender.close()
        receiver.kill()
        newcomer.kill()


def test_a_pair_its_sender_dropped_is_replaced_at_the_next_hand_off() -> None:
    """The sender dropped a pair whose decode process lives on (a transfer that failed mid-way; the prune, when a
    new decode worker appears, of one silent for 2 s). A send to its old store is lost: refused (one sender per
    store) or, once the decode side saw the pair die and closed the store, unanswered till its deadline. The next
    hand-off's rendezvous must be a fresh pair."""
    receiver = ReceiverProcess()
    sender = TorchDistSender(HOST, "cpu", FINGERPRINT, connect_timeout_s=10)
    try:
        receiver.expect(1)
        assert sender.send(receiver.rendezvous, 1, make_caches(1), [0, 1], 10) == receiver.received()
        sender._drop(sender._pairs[receiver.rendezvous])
        with pytest.raises(TransferError):
            sender.send(receiver.rendezvous, 2, make_caches(1), [0, 1], SEND_TIMEOUT_S)
        fresh = receiver.handoff_rendezvous()
        assert fresh != receiver.rendezvous
        receiver.expect(3)
        assert sender.send(fresh, 3, make_caches(1), [0, 1], 10) == receiver.received()
    finally:
        sender.close()
        receiver.kill()


def test_a_rendezvous_never_waits_on_a_pair_its_sender_is_slow_to_build() -> None:
    """A sender claimed the store and its half of the group does not come (slow, paused): the serving thread waits
    in gloo on the pair's store client for up to the connect timeout. The next rendezvous asks the store about
    claims over a client of its own, and outside the receiver's lock, which a cancel (called on the decode
    worker's event loop) takes too."""
    receiver = TorchDistReceiver(HOST, "cpu", FINGERPRINT, connect_timeout_s=8)
    try:
        address = receiver.rendezvous("p")
        claim_store(address, device_info(torch.device("cpu"), "gloo"), time.monotonic() + 5, "test")
        time.sleep(0.5)  # the serving thread is building the group
        start = time.monotonic()
        assert receiver.rendezvous("p") == address  # claimed once: the pair stands
        receiver.cancel("other", 1)
        assert time.monotonic() - start < 2.0
    finally:
        receiver.close()

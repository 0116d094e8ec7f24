"""A transfer's deadline keeps it from starting, never cuts its bytes: over real gloo pairs (a spawned sender, the
receiver in this process), a transfer that starts late in its timeout, on either side, completes, and its pair
(with every transfer that would queue on it) survives.

A timeout mid-transfer makes gloo close the pair. Each test makes its transfer start late and then pause
mid-way past the deadline it had when it was posted, within the timeout counted from its start.
"""

from __future__ import annotations

import json
import time

import pytest

from pdserve.transfer.torch_dist import TorchDistReceiver
from tests.unit.transfer.pair_harness import Peer, Recv, assert_landed, make_caches

pytestmark = pytest.mark.timeout(120)
DST_IDS = [5, 9, 2]


def test_a_transfer_claimed_just_before_its_recv_deadline_completes_and_keeps_the_pair(
    receiver: TorchDistReceiver,
) -> None:
    """The header is claimed 3.5 s into its recv's 6 s (the transfer waited behind others on the pair, or the
    prompt took long), then its bytes pause 4 s. Before, the serving thread received them until the recv's own
    deadline: gloo timed out mid-receive and closed the pair, and the next transfer's rendezvous was a new one."""
    rendezvous = receiver.rendezvous("prefill-late")
    slow = Peer(slow_at=2)
    try:
        slow.call(op="connect", rendezvous=rendezvous)
        kv = make_caches(6)
        before = [t.clone() for t in kv]
        r = Recv(receiver, "prefill-late", 80, kv, DST_IDS, timeout=6.0)
        time.sleep(3.5)
        send = {"rendezvous": rendezvous, "seed": 2, "ids": [1, 8, 3], "timeout": 6.0, "stall_s": 4.0}
        assert slow.call(op="send", tag=80, **send) == {"nbytes": r.join()}
        assert_landed(kv, before, make_caches(2), [1, 8, 3], DST_IDS)
        assert receiver.rendezvous("prefill-late") == rendezvous  # the pair survived
        r = Recv(receiver, "prefill-late", 81, kv, DST_IDS)
        assert slow.call(op="send", tag=81, **(send | {"seed": 3, "stall_s": 0})) == {"nbytes": r.join()}
        assert_landed(kv, before, make_caches(3), [1, 8, 3], DST_IDS)
    finally:
        slow.close()


def test_a_send_that_waited_for_its_turn_on_the_pair_gets_its_timeout_for_the_wire(
    receiver: TorchDistReceiver,
) -> None:
    """Two sends on one pair: the second (timeout 10 s) waits 8 s for the first, whose bytes pause that long, and
    its recv is posted 12 s after it began (its decode worker busy): its header waits to be claimed. Before, its
    deadline counted from before its wait for the pair: it timed out waiting for the status, and the sender
    dropped the pair."""
    rendezvous = receiver.rendezvous("prefill-queued")
    slow = Peer(slow_at=2)
    try:
        slow.call(op="connect", rendezvous=rendezvous)
        kv_first, kv_second = make_caches(6), make_caches(7)
        before = [t.clone() for t in kv_second]
        first = Recv(receiver, "prefill-queued", 90, kv_first, DST_IDS, timeout=30)
        send = {"rendezvous": rendezvous, "ids": [1, 8, 3], "stall_s": 0}
        items = [send | {"tag": 90, "seed": 2, "timeout": 30, "stall_s": 8.0}, send | {"tag": 91, "seed": 3}]
        items[1] |= {"timeout": 10.0, "after_s": 0.5}  # the first holds the pair by then
        slow.conn.send_bytes(json.dumps({"op": "send_many", "items": items}).encode())  # answered below
        time.sleep(12)
        second = Recv(receiver, "prefill-queued", 91, kv_second, DST_IDS, timeout=30)
        assert slow.reply() == [{"nbytes": first.join()}, {"nbytes": second.join()}]
        assert_landed(kv_second, before, make_caches(3), [1, 8, 3], DST_IDS)
        assert receiver.rendezvous("prefill-queued") == rendezvous  # the pair survived
        third = Recv(receiver, "prefill-queued", 92, kv_second, DST_IDS)
        assert slow.call(op="send", tag=92, seed=4, timeout=10.0, **send) == {"nbytes": third.join()}
        assert_landed(kv_second, before, make_caches(4), [1, 8, 3], DST_IDS)
    finally:
        slow.close()

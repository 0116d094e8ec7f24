"""A transfer's deadline keeps it from starting, never cuts its bytes: over real gloo pairs (a spawned sender, the
receiver in this process), a transfer that starts late in its recv's timeout completes, and its pair (with every
transfer that would queue on it) survives.

A timeout mid-transfer makes gloo close the pair. Each test makes its transfer start late and then pause
mid-way past the deadline it had when it was posted, within the timeout counted from its start.
"""

from __future__ import annotations

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

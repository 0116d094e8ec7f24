"""A prefill worker's pairs with decode processes that are gone are pruned when a new pair connects, quietly."""

from __future__ import annotations

from pdserve.transfer.torch_dist import TorchDistSender
from tests.unit.transfer.pair_harness import FINGERPRINT, HOST, ReceiverProcess, assert_only_pair, make_caches


def test_a_gone_receivers_pair_is_pruned_without_torchs_cpp_stack_trace(capfd) -> None:
    """A new pair prunes those of decode processes gone: a store that refuses connections is lost without the store
    round trip, whose failure torch writes to stderr as an 18-line C++ stack trace (a day-2 review found one in the
    prefill log at every decode worker's drain)."""
    receivers = [ReceiverProcess()]
    s = TorchDistSender(HOST, "cpu", FINGERPRINT, connect_timeout_s=10)
    kv = make_caches(8)
    try:
        receivers[0].expect(1)
        assert s.send(receivers[0].rendezvous, 1, kv, [2, 3], 10) == receivers[0].received()
        receivers[0].kill()
        receivers.append(ReceiverProcess())
        receivers[1].expect(2)
        assert s.send(receivers[1].rendezvous, 2, kv, [2, 3], 10) == receivers[1].received()
        assert_only_pair(s, receivers[1].rendezvous)
        assert "recvValue failed" not in capfd.readouterr().err
    finally:
        s.close()
        for receiver in receivers:
            receiver.kill()

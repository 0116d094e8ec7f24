"""One decode-side receiver and one spawned prefill sender per test module (see pair_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.transfer.torch_dist import TorchDistReceiver
from tests.unit.transfer.pair_harness import FINGERPRINT, HOST, Peer


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

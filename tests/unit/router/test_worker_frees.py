"""A stream's place in its decode worker's frees, read from its call's trailing metadata: only a count its worker
said, of a worker whose process the router knows; anything else leaves the stream to the router's clock."""

from __future__ import annotations

from pdserve.rpc.metadata import PREFILL_WAITED_KEY, SEQUENCES_FREED_KEY
from services.router.worker_frees import FreedAt, freed_at


def test_the_count_its_worker_said_is_read_beside_other_metadata() -> None:
    trailing = ((PREFILL_WAITED_KEY, "12"), (SEQUENCES_FREED_KEY, "4711"))
    assert freed_at("process-a", trailing) == FreedAt("process-a", 4711)


def test_a_stream_whose_worker_said_nothing_usable_is_left_to_the_routers_clock() -> None:
    assert freed_at("process-a", None) is None  # the call failed or was cut
    assert freed_at("process-a", ((PREFILL_WAITED_KEY, "12"),)) is None  # a worker of an earlier build
    assert freed_at("process-a", ((SEQUENCES_FREED_KEY, "-3"),)) is None
    assert freed_at("process-a", ((SEQUENCES_FREED_KEY, b"\x01"),)) is None
    assert freed_at("", ((SEQUENCES_FREED_KEY, "4711"),)) is None  # a worker too old to say its process

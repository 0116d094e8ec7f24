"""The KV layout both sides compare, the transfer header and the block spans messages are cut from: no processes."""

from __future__ import annotations

import pytest
import torch

from pdserve.transfer.base import LayoutMismatchError, PeerLostError
from pdserve.transfer.blocks import Blocks
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.pipeline import Message, plan
from pdserve.transfer.wire import HEADER_LEN, MAX_SEGMENTS, Header


def test_layout_from_caches_and_bytes() -> None:
    kv = [torch.zeros(2, 24, 4, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    layout = KVLayout.from_caches(kv, "m")
    assert layout == KVLayout("m", "bfloat16", 4, 3, 2, 8)
    assert layout.bytes_for(5) == 3 * 5 * 2 * 4 * 2 * 8 * 2 == sum(t[:, :5].numel() * 2 for t in kv)
    with pytest.raises(ValueError, match="layer 1"):
        KVLayout.from_caches([kv[0], kv[1].float()], "m")


def test_layout_mismatch_names_every_differing_field() -> None:
    a = KVLayout("m", "bfloat16", 16, 30, 3, 64)
    a.check_compatible(KVLayout("m", "bfloat16", 16, 30, 3, 64))
    with pytest.raises(LayoutMismatchError, match=r"head_dim 64 here vs 128.*") as e:
        a.check_compatible(KVLayout("m", "bfloat16", 16, 30, 3, 128))
    assert "num_kv_heads" not in str(e.value)
    with pytest.raises(LayoutMismatchError, match="model_fingerprint.*dtype"):
        a.check_compatible(KVLayout("other", "float32", 16, 30, 3, 64))


@pytest.mark.parametrize(
    ("ids", "runs"),
    [
        ([7], (1,)),
        ([3, 4, 5, 9, 10, 2], (3, 2, 1)),
        ([5, 4, 3], (1, 1, 1)),
        ([9, 1, 2, 3, 7], (1, 3, 1)),
        (list(range(40, 0, -2)), (20,)),
    ],
)
def test_a_sender_cuts_its_ids_at_the_breaks_between_runs(ids: list[int], runs: tuple[int, ...]) -> None:
    kv = torch.zeros(2, 64, 4, 2, 8)
    blocks = Blocks.from_ids(ids, kv, distinct=True)
    assert blocks.runs(MAX_SEGMENTS) == runs  # more than MAX_SEGMENTS runs: one span, gathered
    start = 0
    for length in runs:  # each span of a run comes straight out of the cache, anything else does not
        direct = blocks.direct(kv, 1, start, length)
        is_run = ids[start : start + length] == list(range(ids[start], ids[start] + length))
        assert (direct is not None) == is_run
        if direct is not None:
            assert direct.data_ptr() == kv[1, ids[start]].data_ptr() and direct.numel() == length * 4 * 2 * 8 * 4
        start += length


def test_header_round_trips_and_messages_follow_its_segments() -> None:
    layout = KVLayout("m", "bfloat16", 16, 30, 3, 64)
    header = Header.for_transfer(42, 6, layout, timeout_s=2.5, segments=(3, 2, 1))
    encoded = header.encode()
    assert encoded.shape == (HEADER_LEN,) and encoded.dtype == torch.int64
    assert Header.decode(encoded) == header
    assert header.block_bytes == 16 * 3 * 64 * 2
    messages = plan(2, header.segments)
    assert messages[:4] == [Message(0, 0, 0, 3), Message(0, 0, 3, 2), Message(0, 0, 5, 1), Message(0, 1, 0, 3)]
    assert len(messages) == 2 * 2 * 3 and messages[-1] == Message(1, 1, 5, 1)


@pytest.mark.parametrize("segments", [(3, 2), (4, 0, 2), (1,) * MAX_SEGMENTS + (6 - MAX_SEGMENTS,)])
def test_a_header_whose_segments_do_not_split_its_blocks_is_a_protocol_error(segments: tuple[int, ...]) -> None:
    header = Header.for_transfer(1, 6, KVLayout("m", "bfloat16", 16, 30, 3, 64), 1.0, segments=(6,))
    encoded = header.encode()
    encoded[12] = len(segments)
    encoded[13 : 13 + len(segments)] = torch.tensor(segments)
    with pytest.raises(PeerLostError, match="protocol error"):
        Header.decode(encoded)


@pytest.mark.parametrize(("word", "value"), [(7, 2**31), (7, 0), (10, 2**40), (11, 10**12), (11, -1)])
def test_a_header_sized_past_any_model_is_a_protocol_error(word: int, value: int) -> None:
    """Layers (word 7), block bytes (10), the transfer's timeout (11): a drain sized by such a header would build
    billions of messages, allocate a terabyte, or hold the pair for years."""
    encoded = Header.for_transfer(1, 6, KVLayout("m", "bfloat16", 16, 30, 3, 64), 1.0, segments=(6,)).encode()
    encoded[word] = value
    with pytest.raises(PeerLostError, match="protocol error: header .* outside 1\\.\\."):
        Header.decode(encoded)

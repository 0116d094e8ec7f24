"""RequestOutput.followed_by: two steps' outputs as one message."""

from __future__ import annotations

from pdserve.protocol.outputs import FinishReason, RequestOutput


def test_a_merged_output_keeps_the_order_the_later_finish_and_the_hand_off_blocks():
    """And the later's count of sequences freed: a finished one's says when its blocks were free."""
    first = RequestOutput("r", [1], "a", None, 7, 0, handoff_block_ids=(3, 4), sequences_freed=4)
    later = RequestOutput("r", [2, 3], "bc", FinishReason.LENGTH, 7, 2, sequences_freed=5)
    merged = first.followed_by(later)
    assert merged == RequestOutput("r", [1, 2, 3], "abc", FinishReason.LENGTH, 7, 2, (3, 4), sequences_freed=5)
    assert first.new_token_ids == [1] and later.new_token_ids == [2, 3]  # neither input changes

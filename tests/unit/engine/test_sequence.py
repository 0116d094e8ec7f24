from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.engine.sequence import Sequence
from pdserve.protocol.sampling import SamplingParams

_ids = st.lists(st.integers(0, 1000), max_size=20)


@given(prompt=_ids.filter(bool), output=_ids, start=st.integers(0, 45), length=st.integers(0, 45))
def test_token_slice_is_the_slice_of_every_token(prompt: list[int], output: list[int], start: int, length: int) -> None:
    seq = Sequence("s", prompt, SamplingParams(), output_token_ids=output)
    assert seq.token_slice(start, start + length) == seq.token_ids[start : start + length]

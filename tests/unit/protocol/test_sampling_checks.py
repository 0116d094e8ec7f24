"""A refused number is named as the caller can act on it: a finite value past a float32 field's range arrives as
infinite, and the message says so (a caller who sent 1e39 otherwise reads "got inf")."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.protocol.request_checks import check_slo_ms
from pdserve.protocol.sampling import SamplingParams
from pdserve.v1 import generate_pb2 as pb


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "repetition_penalty"])
def test_a_value_past_float32_is_refused_saying_why_it_reads_infinite(field):
    wire = pb.SamplingParams(**{field: 1e39})  # what a float32 field makes of it
    with pytest.raises(InvalidRequestError, match=r"got inf \(a float32 field holds at most 3.4e38"):
        SamplingParams(max_tokens=1, **{field: getattr(wire, field)})


def test_an_slo_past_float32_is_refused_saying_why_and_an_ordinary_bad_value_as_it_is():
    with pytest.raises(InvalidRequestError, match="got inf \\(a float32"):
        check_slo_ms("slo.ttft_ms", pb.SLO(ttft_ms=1e39).ttft_ms)
    with pytest.raises(InvalidRequestError, match="got -5.0$"):
        check_slo_ms("slo.ttft_ms", -5.0)

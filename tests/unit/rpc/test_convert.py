"""The one pair of sampling conversions: what the router sends a worker is what the worker rebuilds."""

from __future__ import annotations

import math

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.protocol.sampling import SamplingParams
from pdserve.rpc.convert import sampling_from_pb, sampling_to_pb
from pdserve.v1 import generate_pb2 as pb


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(max_tokens=7, temperature=0.5, top_p=0.25, top_k=3, seed=0, ignore_eos=True),
        SamplingParams(max_tokens=1, seed=2**64 - 1, stop=("\n\n", "€nd"), stop_token_ids=(0, 5, 258)),
        SamplingParams(presence_penalty=0.5, frequency_penalty=-1.25, repetition_penalty=1.5),
        SamplingParams(logprobs=0),
        SamplingParams(logprobs=20, prompt_logprobs=0),
        SamplingParams(logit_bias=((3, -100.0), (7, 0.5))),
    ],
)
def test_round_trip_is_exact(params):
    """Every field set on the wire, so a worker passes no default and gets the router's values back."""
    assert sampling_from_pb(sampling_to_pb(params)) == params
    assert sampling_from_pb(pb.SamplingParams.FromString(sampling_to_pb(params).SerializeToString())) == params


def test_proto_zero_values_take_the_defaults():
    got = sampling_from_pb(pb.SamplingParams(), default_max_tokens=9)
    assert (got.max_tokens, got.top_p, got.seed, got.temperature) == (9, 1.0, None, 0.0)
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not got.penalized and got.logprobs is None and got.prompt_logprobs is None


def test_an_unset_max_tokens_without_a_default_is_an_error():
    """A worker passes no default: a forwarded request without max_tokens is a bug to see, not to guess."""
    with pytest.raises(InvalidRequestError) as err:
        sampling_from_pb(pb.SamplingParams(seed=0))
    assert err.value.field == "sampling.max_tokens"


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (pb.SamplingParams(max_tokens=1, temperature=math.inf), "sampling.temperature"),
        (pb.SamplingParams(max_tokens=1, temperature=-math.inf), "sampling.temperature"),
        (pb.SamplingParams(max_tokens=1, temperature=math.nan), "sampling.temperature"),
        (pb.SamplingParams(max_tokens=1, top_p=math.inf), "sampling.top_p"),
        (pb.SamplingParams(max_tokens=1, top_p=-0.1), "sampling.top_p"),
        (pb.SamplingParams(max_tokens=1, presence_penalty=2.5), "sampling.presence_penalty"),
        (pb.SamplingParams(max_tokens=1, presence_penalty=math.nan), "sampling.presence_penalty"),
        (pb.SamplingParams(max_tokens=1, frequency_penalty=-3), "sampling.frequency_penalty"),
        (pb.SamplingParams(max_tokens=1, repetition_penalty=-1), "sampling.repetition_penalty"),
        (pb.SamplingParams(max_tokens=1, repetition_penalty=math.inf), "sampling.repetition_penalty"),
        (pb.SamplingParams(max_tokens=1, logprobs=21), "sampling.logprobs"),
        (pb.SamplingParams(max_tokens=1, prompt_logprobs=21), "sampling.prompt_logprobs"),
        (pb.SamplingParams(max_tokens=1, logit_bias={3: 100.5}), "sampling.logit_bias[3]"),
        (pb.SamplingParams(max_tokens=1, top_k=-2), "sampling.top_k"),  # -1 is off, as vLLM has it
        (pb.SamplingParams(max_tokens=1, stop=["a", ""]), "sampling.stop"),
    ],
)
def test_the_dataclass_names_the_public_field(msg, field):
    with pytest.raises(InvalidRequestError) as err:
        sampling_from_pb(msg)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")

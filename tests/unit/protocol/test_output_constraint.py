"""An output constraint that does not compile is the request's fault, refused naming its field before any worker
sees it; one constraint at most; the gRPC fields carry it to the workers unchanged."""

from __future__ import annotations

import json

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.protocol.output_constraint import MAX_SPEC_BYTES, OutputConstraint
from pdserve.rpc.convert import sampling_from_pb, sampling_to_pb
from pdserve.v1 import generate_pb2 as pb

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.mark.parametrize(
    ("kind", "spec", "field", "says"),
    [
        ("json_schema", "{not json", "sampling.json_schema", "is not valid JSON"),
        ("json_schema", "[1, 2]", "sampling.json_schema", "must be a JSON Schema object"),
        ("json_schema", '{"type": "nonsense"}', "sampling.json_schema", "does not compile: Invalid type"),
        ("regex", "[a-", "sampling.regex", "does not compile"),
        ("regex", "", "sampling.regex", "must not be empty"),
        ("regex", "a" * (MAX_SPEC_BYTES + 1), "sampling.regex", f"at most {MAX_SPEC_BYTES}"),
        ("regex", "a\udcff", "sampling.regex", "lone UTF-16 surrogate"),  # a command line's byte 0xff
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_naming_its_field(kind, spec, field, says):
    with pytest.raises(InvalidRequestError, match=says) as e:
        OutputConstraint(kind, spec)
    assert e.value.field == field


def test_the_wire_carries_one_constraint_at_most():
    for fields, constraint in (
        ({"json_schema": SCHEMA}, OutputConstraint("json_schema", SCHEMA)),
        ({"json_object": True}, OutputConstraint("json_object")),
        ({"regex": "[0-9]+"}, OutputConstraint("regex", "[0-9]+")),
        ({}, None),
    ):
        params = sampling_from_pb(pb.SamplingParams(max_tokens=4, **fields))
        assert params.constraint == constraint
        assert sampling_from_pb(sampling_to_pb(params)) == params  # what the router sends, a worker reads
    with pytest.raises(InvalidRequestError, match="at most one output constraint; json_schema and regex") as e:
        sampling_from_pb(pb.SamplingParams(max_tokens=4, json_schema=SCHEMA, regex="x"))
    assert e.value.field == "sampling.regex"

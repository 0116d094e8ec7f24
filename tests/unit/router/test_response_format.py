"""OpenAI's response_format (and pdserve's regex) becomes the gRPC API's output constraint: json_object, json_schema's
schema, the regex; text asks for nothing; anything else is refused naming the parameter, as is a schema the shared
path cannot compile."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.model_files import locate_model, read_model_config
from pdserve.errors import InvalidRequestError
from pdserve.protocol.request_checks import RequestLimits
from pdserve.rpc.convert import sampling_from_pb
from services.router.http.openai_request import openai_param, parse_request

TINY = read_model_config(locate_model("tiny-random"))
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def sampling(response_format: object, chat: bool = True):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if chat else {"model": "m", "prompt": "hi"}
    req = parse_request(body | {"response_format": response_format}, chat, limits=RequestLimits(), model_config=TINY)
    return req.message.sampling


def test_each_format_sets_its_constraint():
    assert not any((s := sampling({"type": "text"})).json_schema or s.json_object or s.regex)
    assert sampling({"type": "json_object"}, chat=False).json_object
    schema = sampling({"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}})
    nulls = sampling({"type": "json_schema", "json_schema": {"name": "x", "strict": None, "description": None}})
    assert json.loads(nulls.json_schema) == {}  # null: not given, as OpenAI takes it
    assert json.loads(schema.json_schema) == SCHEMA
    assert json.loads(sampling({"type": "json_schema", "json_schema": {"name": "any"}}).json_schema) == {}
    accents = {"type": "object", "properties": {"é" * 40_000: {"type": "string"}}}  # 80 KB as UTF-8, 240 KB escaped
    assert len(sampling({"type": "json_schema", "json_schema": {"name": "fr", "schema": accents}}).json_schema) < 40_100


@pytest.mark.parametrize(
    ("response_format", "field"),
    [
        ({"type": "xml"}, "response_format"),
        ("json", "response_format"),
        ({"type": "json_object", "schema": {}}, "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}, "response_format.json_schema.strict"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "description": 1}},
            "response_format.json_schema.description",
        ),
        # A lone surrogate, which JSON's \ud800 escape reads into a Python string but no protobuf string holds.
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["\ud800"]}}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_a_malformed_format_is_refused_naming_the_parameter(response_format, field):
    with pytest.raises(InvalidRequestError) as e:
        sampling(response_format)
    assert e.value.field == field


def test_a_schema_that_does_not_compile_names_the_openai_parameter():
    bad = sampling({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    with pytest.raises(InvalidRequestError) as e:
        sampling_from_pb(bad, 16)  # the shared path's check, as the router runs it
    assert openai_param(e.value.field) == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    ("regex", "problem"), [("", "must not be empty"), (5, "must be a string"), ("a\ud800", "lone UTF-16 surrogate")]
)
def test_a_regex_the_wire_cannot_carry_is_refused_naming_it(regex, problem):
    """An empty one would reach the gRPC request as no constraint at all: asked for, it is refused, not dropped."""
    body = {"model": "m", "prompt": "hi", "regex": regex}
    with pytest.raises(InvalidRequestError, match=problem) as e:
        parse_request(body, False, limits=RequestLimits(), model_config=TINY)
    assert e.value.field == "regex"

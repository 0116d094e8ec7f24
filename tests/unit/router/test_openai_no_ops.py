"""Unimplemented OpenAI parameters at values that ask for nothing are taken, as clients ported from vLLM or OpenAI
send them; any other value is refused by name."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidRequestError
from tests.unit.router.test_openai_request import parse


def test_what_agent_frameworks_send_at_values_that_ask_for_nothing_is_taken_and_any_other_value_refused():
    """A client ported from vLLM or OpenAI sends tools [] and tool_choice "none", parallel_tool_calls, metadata {},
    service_tier, min_p 0, and a tool message's tool_call_id: a 400 for each broke it (an OpenAI-compatibility
    review), though none asks for anything pdserve does not do."""
    no_ops = {
        "tools": [], "tool_choice": "none", "parallel_tool_calls": False, "metadata": {}, "service_tier": "auto",
        "min_p": 0, "skip_special_tokens": True, "modalities": ["text"],
    }  # fmt: skip
    tool = {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    req = parse({"model": "m", "messages": [{"role": "user", "content": "x"}, tool], **no_ops}, chat=True)
    assert [(m.role, m.content) for m in req.message.messages] == [("user", "x"), ("tool", "42")]
    assert parse({"model": "m", "prompt": "x", "min_p": 0.0, "service_tier": "default"}, chat=False).message.prompt
    refused = (
        ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"), ("min_p", 0.1),
        ("min_p", False), ("metadata", {"k": "v"}), ("service_tier", "flex"), ("skip_special_tokens", False),
        ("modalities", ["text", "audio"]), ("modalities", "text"),
    )  # fmt: skip
    for param, value in refused:
        with pytest.raises(InvalidRequestError) as e:
            parse({"model": "m", "messages": [{"role": "user", "content": "x"}], param: value}, chat=True)
        assert e.value.field == param
    with pytest.raises(InvalidRequestError) as e:
        parse({"model": "m", "messages": [{"role": "tool", "content": "1", "tool_call_id": 7}]}, chat=True)
    assert e.value.field == "messages[0].tool_call_id"


def test_stream_options_include_obfuscation_false_is_taken_and_true_refused():
    """OpenAI's stream_options.include_obfuscation (its chunks' `obfuscation` padding, on by default) set to false,
    as OpenAI's docs suggest on a trusted network, asks for what pdserve's chunks are: it was a 400. True asks for
    padding pdserve does not send: refused by name. A null option is not given, as at the top level."""
    body = {"model": "m", "prompt": "x", "stream": True}
    options = {"include_usage": True, "include_obfuscation": False}
    assert parse(body | {"stream_options": options}, chat=False).include_usage
    assert not parse(body | {"stream_options": {"include_obfuscation": False}}, chat=False).include_usage
    assert parse(body | {"stream_options": {"include_usage": True, "continuous_usage_stats": None}}, chat=False)
    for value in (True, 0, "false"):
        with pytest.raises(InvalidRequestError) as e:
            parse(body | {"stream_options": {"include_obfuscation": value}}, chat=False)
        assert e.value.field == "stream_options.include_obfuscation"

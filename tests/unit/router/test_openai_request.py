"""An OpenAI body's shape -> the GenerateRequest of the gRPC API, and each refused shape named by its parameter."""

from __future__ import annotations

import pytest

from pdserve.engine.model_files import locate_model, read_model_config
from pdserve.errors import InvalidRequestError
from pdserve.protocol.request_checks import RequestLimits
from pdserve.v1 import generate_pb2 as pb
from services.router.http.json_values import parse_json
from services.router.http.openai_request import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    OpenAIRequest,
    openai_param,
    parse_request,
)

TINY = read_model_config(locate_model("tiny-random"))


def parse(body: object, chat: bool, request_id: str = "") -> OpenAIRequest:
    return parse_request(body, chat, limits=RequestLimits(), model_config=TINY, request_id=request_id)


def test_a_completion_becomes_the_grpc_request():
    body = {"model": "m", "prompt": [[5, 6, 7]], "max_tokens": 4, "temperature": 0, "top_p": 0.5, "seed": 3}
    body |= {"stop": "x", "top_k": -1, "ignore_eos": True, "priority": 2, "slo": {"ttft_ms": 500}, "n": 1}
    req = parse(body | {"stream": True, "stream_options": {"include_usage": True}}, chat=False, request_id="r")
    m = req.message
    assert (req.model, req.stream, req.include_usage, req.chat) == ("m", True, True, False)
    assert (m.request_id, list(m.prompt_token_ids), m.priority, m.slo.ttft_ms, m.slo.tpot_ms) == (
        "r",
        [5, 6, 7],
        2,
        500,
        0,
    )
    s = m.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, list(s.stop), s.ignore_eos) == (
        4,
        0.0,
        0.5,
        -1,  # as given: the shared conversion reads it as off, for a gRPC caller's -1 too (test_api_parity)
        3,
        ["x"],
        True,
    )


def test_max_tokens_left_out_is_left_to_the_router_with_openais_16_as_a_completions_default():
    """Unset on the gRPC request, so the router caps the default at the context's room (test_http_defaults)."""
    completion = parse({"model": "m", "prompt": "x"}, chat=False)
    assert completion.message.sampling.max_tokens == 0
    assert completion.default_max_tokens == COMPLETION_DEFAULT_MAX_TOKENS == 16
    chat = parse({"model": "m", "messages": [{"role": "user", "content": "x"}]}, chat=True)
    assert chat.message.sampling.max_tokens == 0 and chat.default_max_tokens is None  # the router's default


def test_a_chat_takes_text_parts_and_openais_defaults():
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_completion_tokens": 9}
    req = parse(body | {"user": None}, chat=True)  # null is "not given"
    assert list(req.message.messages) == [pb.ChatMessage(role="user", content="a\nb")]  # joined as vLLM joins them
    assert req.message.sampling.max_tokens == 9 and req.max_tokens_param == "max_completion_tokens"
    assert req.message.sampling.temperature == 1.0  # OpenAI's default, not the gRPC API's greedy 0
    assert not req.message.sampling.HasField("seed") and not req.stream and not req.include_usage


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": 3, "prompt": "x"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        (
            {"model": "m", "prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ({"model": "m", "prompt": "x", "slo": {"ttft_ms": "fast"}}, "slo.ttft_ms"),
        ({"model": "m", "prompt": "x", "messages": []}, "messages"),
        ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "m", "prompt": "x", "presence_penalty": "high"}, "presence_penalty"),
        ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),  # the gRPC API's "unset"
    ],
)
def test_a_refused_shape_names_its_parameter(body, param):
    with pytest.raises(InvalidRequestError) as e:
        parse(body, chat=False)
    assert e.value.field == param


HUGE = "1" + "0" * 400  # an integer JSON allows and no float holds
COMPLETION = '"model": "m", "prompt": "x"'
CHAT = '"model": "m", "messages": [{"role": "user", "content": "x"}]'
# Raw bodies as they come over the wire (JSON's escapes, Python's NaN and Infinity), each refused naming the
# parameter: none may raise anything but InvalidRequestError.
BAD_VALUES = [
    # numbers past a float's range, or not finite
    (f'{{{COMPLETION}, "temperature": {HUGE}}}', "temperature"),
    (f'{{{COMPLETION}, "top_p": -{HUGE}}}', "top_p"),
    (f'{{{COMPLETION}, "presence_penalty": {HUGE}}}', "presence_penalty"),
    (f'{{{COMPLETION}, "repetition_penalty": {HUGE}}}', "repetition_penalty"),
    (f'{{{COMPLETION}, "logit_bias": {{"5": {HUGE}}}}}', "logit_bias.5"),
    (f'{{{COMPLETION}, "slo": {{"ttft_ms": {HUGE}}}}}', "slo.ttft_ms"),
    (f'{{{COMPLETION}, "max_tokens": {HUGE}}}', "max_tokens"),
    (f'{{{COMPLETION}, "seed": {HUGE}}}', "seed"),
    (f'{{{COMPLETION}, "prompt": [{HUGE}]}}', "prompt"),
    (f'{{{COMPLETION}, "logit_bias": {{"{"1" * 5000}": 1}}}}', "logit_bias"),  # past int()'s digit limit
    (f'{{{COMPLETION}, "temperature": NaN}}', "temperature"),
    (f'{{{COMPLETION}, "top_p": Infinity}}', "top_p"),
    (f'{{{COMPLETION}, "logit_bias": {{"5": -Infinity}}}}', "logit_bias.5"),
    (f'{{{COMPLETION}, "slo": {{"tpot_ms": NaN}}}}', "slo.tpot_ms"),
    (f'{{{COMPLETION}, "n": NaN}}', "n"),
    (f'{{{COMPLETION}, "stop_token_ids": [Infinity]}}', "stop_token_ids"),
    # lone UTF-16 surrogates, which JSON's \u escapes can spell and UTF-8 cannot carry
    (r'{"model": "m", "prompt": "a\ud800b"}', "prompt"),
    (r'{"model": "m", "prompt": ["\udfff"]}', "prompt"),
    (r'{"model": "m\udc00", "prompt": "x"}', "model"),
    (rf'{{{COMPLETION}, "stop": "\ud800"}}', "stop"),
    (rf'{{{COMPLETION}, "stop": ["ok", "\ud800"]}}', "stop[1]"),
    (rf'{{{COMPLETION}, "user": "\ud800"}}', "user"),
    (r'{"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}', "messages[0].content"),
    (r'{"model": "m", "messages": [{"role": "us\ud800", "content": "x"}]}', "messages[0].role"),
    (
        r'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}',
        "messages[0].content[0].text",
    ),
    # other JSON types where strings, integers or objects are expected
    (f'{{{COMPLETION}, "stop": [["a"]]}}', "stop"),
    (f'{{{COMPLETION}, "prompt": [["a"]]}}', "prompt"),
    (f'{{{COMPLETION}, "prompt": [[[1]]]}}', "prompt"),
    (f'{{{COMPLETION}, "prompt": [1, "a"]}}', "prompt"),
    (f'{{{COMPLETION}, "prompt": [true]}}', "prompt"),
    (f'{{{COMPLETION}, "prompt": {{"text": "x"}}}}', "prompt"),
    (f'{{{COMPLETION}, "model": ["m"]}}', "model"),
    (f'{{{COMPLETION}, "n": true}}', "n"),
    (f'{{{COMPLETION}, "max_tokens": 4.5}}', "max_tokens"),
    (f'{{{COMPLETION}, "seed": false}}', "seed"),
    (f'{{{COMPLETION}, "stop_token_ids": [true]}}', "stop_token_ids"),
    (f'{{{COMPLETION}, "stop_token_ids": 5}}', "stop_token_ids"),
    (f'{{{COMPLETION}, "logprobs": true}}', "logprobs"),
    (f'{{{COMPLETION}, "logit_bias": {{"5": true}}}}', "logit_bias.5"),
    (f'{{{COMPLETION}, "logit_bias": [1]}}', "logit_bias"),
    (f'{{{COMPLETION}, "slo": [500]}}', "slo"),
    (f'{{{COMPLETION}, "stream": 1}}', "stream"),
    (f'{{{COMPLETION}, "user": 7}}', "user"),
    (f'{{{COMPLETION}, "safety_identifier": 7, "user": "u"}}', "safety_identifier"),
    (f'{{{CHAT}, "user": 7, "safety_identifier": "u"}}', "user"),
    (f'{{{CHAT}, "prompt_cache_key": ["k"]}}', "prompt_cache_key"),
    (f'{{{CHAT}, "safety_identifier": "{"u" * 129}"}}', "safety_identifier"),  # past OpenAI's cap
    (f'{{{CHAT}, "logprobs": 1}}', "logprobs"),
    ('{"model": "m", "messages": [{"role": ["user"], "content": "x"}]}', "messages[0].role"),
    ('{"model": "m", "messages": [{"role": "user", "content": [["x"]]}]}', "messages[0].content[0]"),
    ('{"model": "m", "messages": [{"role": "user", "content": {"text": "x"}}]}', "messages[0].content"),
    ('{"model": "m", "messages": ["hi"]}', "messages[0]"),
    # not a body at all
    ("[]", "body"),
    ("NaN", "body"),
    ("[" * 100_000 + "]" * 100_000, "body"),  # past the parser's recursion
    ('{"model": "m", "prompt": "x"', "body"),
    ("1" * 5000, "body"),  # past int()'s digit limit
]


@pytest.mark.parametrize(("raw", "param"), BAD_VALUES, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD_VALUES)])
def test_a_bad_json_value_is_refused_naming_its_parameter(raw, param):
    chat = '"messages"' in raw
    with pytest.raises(InvalidRequestError) as e:
        parse(parse_json(raw.encode()), chat=chat)
    assert e.value.field == param


@pytest.mark.parametrize(
    ("part", "wrong"), [({"type": "text"}, "is required"), ({"type": "text", "text": 5}, "a string")]
)
def test_a_text_part_without_its_text_is_told_so_not_that_only_text_parts_are_supported(part, wrong):
    with pytest.raises(InvalidRequestError) as e:
        parse({"model": "m", "messages": [{"role": "user", "content": [part]}]}, chat=True)
    assert e.value.field == "messages[0].content[0].text" and wrong in e.value.message, e.value


def test_penalties_pass_through_and_unset_ones_stay_off():
    body = {"model": "m", "prompt": "x", "presence_penalty": -0.5, "frequency_penalty": 1.5, "repetition_penalty": 1.2}
    s = parse(body, chat=False).message.sampling
    assert (s.presence_penalty, s.frequency_penalty) == (-0.5, 1.5)
    assert s.repetition_penalty == pytest.approx(1.2)  # a float on the wire
    s = parse({"model": "m", "messages": [{"role": "user", "content": "x"}]}, chat=True).message.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.0, 0.0, 0.0)  # 0: off


def test_logprobs_are_a_count_for_completions_and_a_flag_with_a_count_for_chat():
    def logprobs(body: dict, chat: bool) -> int | None:
        base = {"model": "m", "messages": [{"role": "user", "content": "x"}]} if chat else {"model": "m", "prompt": "x"}
        sampling = parse(base | body, chat=chat).message.sampling
        return sampling.logprobs if sampling.HasField("logprobs") else None

    assert (logprobs({}, False), logprobs({"logprobs": 0}, False), logprobs({"logprobs": 5}, False)) == (None, 0, 5)
    assert (logprobs({}, True), logprobs({"logprobs": False}, True)) == (None, None)
    assert (logprobs({"logprobs": True}, True), logprobs({"logprobs": True, "top_logprobs": 3}, True)) == (0, 3)
    for body, chat, param in [
        ({"logprobs": 21}, False, "logprobs"),
        ({"logprobs": True}, False, "logprobs"),  # a count here
        ({"logprobs": 2}, True, "logprobs"),  # a flag here
        ({"top_logprobs": 2}, True, "top_logprobs"),  # OpenAI refuses it without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            logprobs(body, chat)
        assert e.value.field == param, body


def test_echo_with_logprobs_asks_for_the_prompts_too():
    req = parse({"model": "m", "prompt": "x", "echo": True, "logprobs": 2}, chat=False)
    assert req.echo and (req.message.sampling.logprobs, req.message.sampling.prompt_logprobs) == (2, 2)
    req = parse({"model": "m", "prompt": "x", "echo": True}, chat=False)
    assert req.echo and not req.message.sampling.HasField("prompt_logprobs")
    with pytest.raises(InvalidRequestError) as e:  # chat has no echo
        parse({"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": True}, chat=True)
    assert e.value.field == "echo"


def test_each_of_n_choices_is_a_request_of_its_own():
    req = parse({"model": "m", "prompt": "x", "n": 3, "seed": 2**64 - 2}, chat=False, request_id="r")
    choices = [req.choice_message(i) for i in range(req.n)]
    assert [c.request_id for c in choices] == ["r-0", "r-1", "r-2"]
    assert [c.sampling.seed for c in choices] == [2**64 - 2, 2**64 - 1, 0]  # distinct, each reproducible
    assert req.message.request_id == "r" and req.message.sampling.seed == 2**64 - 2  # the body's, untouched
    one = parse({"model": "m", "prompt": "x"}, chat=False, request_id="r")
    assert one.n == 1 and one.choice_message(0) is one.message
    for n in (0, 17):
        with pytest.raises(InvalidRequestError) as e:
            parse({"model": "m", "prompt": "x", "n": n}, chat=False)
        assert e.value.field == "n"


def test_a_batch_is_each_prompts_n_choices_in_order():
    """Choice i is prompt i // n's (OpenAI's and vLLM's index); choice j of each prompt takes seed + j, so each
    prompt is answered as if sent alone with the same body."""
    req = parse({"model": "m", "prompt": ["a", "b"], "n": 2, "seed": 5, "echo": True, "logprobs": 1}, False, "r")
    assert (req.choices, [m.prompt for m in req.prompts], req.message.prompt) == (4, ["a", "b"], "a")
    choices = [req.choice_message(i) for i in range(req.choices)]
    assert [(c.request_id, c.prompt, c.sampling.seed) for c in choices] == [
        ("r-0", "a", 5),
        ("r-1", "a", 6),
        ("r-2", "b", 5),
        ("r-3", "b", 6),
    ]
    assert all(c.sampling.prompt_logprobs == 1 for c in choices)  # each prompt's own echo
    ids = parse({"model": "m", "prompt": [[5, 6], [7]]}, chat=False)
    assert [list(m.prompt_token_ids) for m in ids.prompts] == [[5, 6], [7]] and ids.choices == 2


@pytest.mark.parametrize(
    ("prompt", "n", "message"),
    [
        (["a", [5]], 1, "a batch must be all strings or all lists of token ids, not a mix"),
        ([[5], "a"], 1, "a batch must be all strings or all lists of token ids, not a mix"),
        (["a", ""], 1, "prompt 1 must not be empty"),
        ([[5], []], 1, "prompt 1 must not be empty"),
        ([[5], [6, -1]], 1, "prompt 1 must be a string or a non-empty list of token ids (integers >= 0)"),
        ([[5], [[6]]], 1, "prompt 1 must be a string or a non-empty list of token ids (integers >= 0)"),
        (["a"] * 17, 1, "a batch of 17 prompts; at most 16 are accepted"),
        (["a"] * 5, 4, "a batch of 5 prompts with n=4 is 20 choices; at most 16 are accepted"),
        ([[5]] * 2, 9, "a batch of 2 prompts with n=9 is 18 choices; at most 16 are accepted"),
    ],
)
def test_a_bad_batch_is_refused_naming_prompt(prompt, n, message):
    with pytest.raises(InvalidRequestError) as e:
        parse({"model": "m", "prompt": prompt, "n": n}, chat=False)
    assert (e.value.field, str(e.value)) == ("prompt", f"prompt: {message}")


def test_a_batch_too_large_is_refused_before_its_prompts_are_read():
    """The cap on prompts, and each token list's length, come before any prompt's items are checked."""
    with pytest.raises(InvalidRequestError, match="a batch of 17 prompts"):
        parse({"model": "m", "prompt": [[-1]] * 17}, chat=False)
    with pytest.raises(InvalidRequestError, match="leave no room"):
        parse({"model": "m", "prompt": [[-1], [1] * TINY.max_position_embeddings]}, chat=False)


def test_a_chat_message_with_other_fields_is_refused_by_name():
    with pytest.raises(InvalidRequestError) as e:
        parse({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, chat=True)
    assert e.value.field == "messages[0].tool_calls"
    with pytest.raises(InvalidRequestError) as e:
        parse({"model": "m", "messages": [{"role": "user", "content": "x", "name": 3}]}, chat=True)
    assert e.value.field == "messages[0].name"


def test_what_openais_clients_send_by_default_is_taken():
    """Clients echo a response's message back (refusal and tool_calls null), LangChain names messages and sends
    `developer` ones, SDK wrappers and older vLLM benchmarks send unimplemented parameters at their no-op value,
    and explicit nulls mean "not given" inside objects too."""
    echoed = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None, "function_call": None}
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "x", "name": "bob"}, echoed]
    body = {"model": "m", "messages": messages, "response_format": {"type": "text"}, "store": False}
    req = parse(body | {"slo": {"ttft_ms": None, "tpot_ms": 40}}, chat=True)
    assert [(m.role, m.content) for m in req.message.messages] == [
        ("developer", "be brief"),  # as given: the shared path takes it as system, for gRPC too (test_api_parity)
        ("user", "x"),
        ("assistant", "hi"),
    ]
    assert (req.message.slo.ttft_ms, req.message.slo.tpot_ms) == (0, 40)
    assert parse({"model": "m", "prompt": "x", "best_of": 1}, chat=False).message.prompt == "x"
    for param, value in (("best_of", 2), ("best_of", True), ("response_format", {"type": "xml"})):
        with pytest.raises(InvalidRequestError) as e:
            parse({"model": "m", "prompt": "x", param: value}, chat=False)
        assert e.value.field == param
    with pytest.raises(InvalidRequestError) as e:  # a bias must be a number: no default stands in for it
        parse({"model": "m", "prompt": "x", "logit_bias": {"5": None}}, chat=False)
    assert e.value.field == "logit_bias.5"


def test_the_end_user_id_is_the_safety_identifier_over_user_and_at_most_128_characters():
    body = {"model": "m", "prompt": "x"}
    assert parse(body | {"user": "old", "safety_identifier": "new"}, chat=False).user == "new"
    assert parse(body | {"safety_identifier": "s" * 128}, chat=False).user == "s" * 128
    assert parse(body | {"user": "u" * 1000}, chat=False).user == "u" * 128  # OpenAI caps no `user`: cut, not refused


def test_the_shared_paths_field_names_read_as_openai_parameters():
    assert openai_param("sampling.max_tokens", "max_completion_tokens") == "max_completion_tokens"
    assert openai_param("sampling.stop[1]") == "stop[1]"
    assert openai_param("prompt_token_ids") == "prompt"
    assert (openai_param("slo.tpot_ms"), openai_param("messages[2].role")) == ("slo.tpot_ms", "messages[2].role")
    assert openai_param("sampling.logit_bias[70]") == "logit_bias.70"  # as a bias that is no number is named


def test_a_negative_seed_is_taken_as_vllm_takes_it():
    for seed, carried in ((-1, 2**64 - 1), (-(2**63), 2**63), (7, 7)):
        body = {"model": "m", "prompt": "hi", "seed": seed}
        assert parse(body, chat=False, request_id="r").message.sampling.seed == carried
    with pytest.raises(InvalidRequestError, match="seed"):
        parse({"model": "m", "prompt": "hi", "seed": -(2**63) - 1}, chat=False, request_id="r")


OVER_THE_CAPS = [  # each list or object one item past its cap, a bad item in it: the count is what is refused
    (False, {"prompt": [5] * TINY.max_position_embeddings + ["x"]}, "prompt", "tokens leave no room"),
    (False, {"prompt": [[5] * TINY.max_position_embeddings + ["x"]]}, "prompt", "tokens leave no room"),
    (False, {"prompt": "x", "stop": [0] * 17}, "sampling.stop", "17 stop strings; at most 16"),
    (False, {"prompt": "x", "stop_token_ids": ["x"] * 65}, "sampling.stop_token_ids", "65 ids; at most 64"),
    (False, {"prompt": "x", "logit_bias": {f"x{i}": 1 for i in range(1025)}}, "sampling.logit_bias", "1025 token"),
    (True, {"messages": [0] * 1025}, "messages", "1025 messages; at most 1024"),
]


@pytest.mark.parametrize(("chat", "body", "field", "message"), OVER_THE_CAPS)
def test_counts_past_the_caps_are_refused_before_any_item_is_read(chat, body, field, message):
    """Items are checked one by one in Python, which for a 16 MiB body held the router's loop for a second."""
    with pytest.raises(InvalidRequestError, match=message) as e:
        parse({"model": "m"} | body, chat=chat)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("raw", "param", "says"),
    [
        (f'{{{COMPLETION}, "logit_bias": {{"70": 100, "070": -100}}}}', "logit_bias", "token id 70 more than once"),
        (f'{{{COMPLETION}, "slo": 5}}', "slo", "must be an object, got integer"),
        (f'{{{COMPLETION}, "slo": {{"ttft_ms": 1e-46}}}}', "slo.ttft_ms", "1e-46 is too small to be an SLO"),
        (f'{{{COMPLETION}, "slo": {{"tpot_ms": -1e-46}}}}', "slo.tpot_ms", "must be a finite number >= 0"),
        (f'{{{COMPLETION}, "stop_token_ids": {{}}}}', "stop_token_ids", "must be an array"),
        (f'{{{COMPLETION}, "": 1}}', "body", 'a parameter named "" is not supported'),
        ("1" * 5000, "body", "a number has more than 4300 digits"),
    ],
)
def test_a_refusal_says_what_is_wrong_in_the_callers_terms(raw, param, says):
    """One token named twice is refused as the shared path refuses it, not settled by the last key; an SLO too small
    for the API's float32 is not read as 0 (the server's default); no message reads as advice to the server's code
    ("use sys.set_int_max_str_digits()")."""
    with pytest.raises(InvalidRequestError) as e:
        parse(parse_json(raw.encode()), chat=False)
    assert e.value.field == param and says in str(e.value), str(e.value)
    assert "sys." not in str(e.value)


def test_an_integer_parameter_takes_a_float_with_an_integral_value_as_vllm_does():
    """`"max_tokens": 3.0` (some JSON writers send every number so) was refused as "got number"; 3.5 still is."""
    completion = {"max_tokens": 3.0, "n": 2.0, "top_k": 5.0, "seed": -7.0, "priority": 1.0, "logprobs": 2.0}
    req = parse({"model": "m", "prompt": "x"} | completion, chat=False)
    s = req.message.sampling
    assert (s.max_tokens, req.n, s.top_k, s.seed, req.message.priority, s.logprobs) == (3, 2, 5, 2**64 - 7, 1, 2)
    chat = {"max_completion_tokens": 4.0, "logprobs": True, "top_logprobs": 3.0}
    s = parse({"model": "m", "messages": [{"role": "user", "content": "x"}]} | chat, chat=True).message.sampling
    assert (s.max_tokens, s.logprobs) == (4, 3)
    for param, value in [("max_tokens", 3.5), ("n", 1.5), ("top_k", -0.5), ("seed", 1e-3), ("priority", 0.1)]:
        with pytest.raises(InvalidRequestError) as e:
            parse({"model": "m", "prompt": "x", param: value}, chat=False)
        assert e.value.field == param and str(e.value) == f"{param}: must be an integer, got {value:g}"
    with pytest.raises(InvalidRequestError) as e:
        parse({"model": "m", "prompt": "x", "max_tokens": 0.0}, chat=False)  # in range as an integer is
    assert str(e.value).startswith("max_tokens: must be in [1, ")

"""The sampling controls of the OpenAI-compatible API (penalties, log probabilities, `echo`, `n`, `logit_bias`,
stop token ids, output constraints) on a real `pdserve up --http-port`: each reaches the prefill worker, which
samples the first token, and the decode worker, which samples the rest, and answers as the single-process engine
and the gRPC path do."""

from __future__ import annotations

import json
import re
from typing import Literal

import grpc
import jsonschema
import openai
import pydantic
import pytest

from pdserve import cli
from pdserve.protocol.output_constraint import OutputConstraint
from pdserve.v1 import generate_pb2 as pb
from tests.integration.openai_cluster import IGNORE_EOS, MODEL, TOKENIZER, grpc_result, http_cluster, openai_client
from tests.integration.reference import MAX_TOKENS, PROMPT, greedy, greedy_completion

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with http_cluster(tmp_path_factory.mktemp("openai_sampling") / "cluster.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


def test_penalties_reach_the_engine_as_the_single_process_engine_applies_them(cluster, client):
    """OpenAI's presence and frequency penalties and vLLM's repetition_penalty, through prefill (first token)
    and decode (the rest): the gRPC path's tokens are the single-process engine's, the HTTP path's text theirs."""
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.25}
    expected = greedy(PROMPT, MAX_TOKENS, **penalties)
    assert expected != greedy(PROMPT, MAX_TOKENS)  # they matter for this prompt

    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **penalties)
    result = grpc_result(cluster, prompt_token_ids=PROMPT, sampling=sampling)
    assert result.token_ids == expected
    extra = {"ignore_eos": True, "repetition_penalty": 1.25}
    answer = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=1.0,
        extra_body=extra,
    )
    assert answer.choices[0].text == result.text


def test_logprobs_are_the_single_process_engines_over_grpc_and_in_openais_shapes(cluster, client):
    """The first token's come from the prefill worker, the rest from the decode worker."""
    expected = greedy_completion(PROMPT, MAX_TOKENS, logprobs=2)

    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    result = grpc_result(cluster, prompt_token_ids=PROMPT, sampling=sampling)
    assert result.token_ids == expected.token_ids and len(result.logprobs) == MAX_TOKENS
    for got, want in zip(result.logprobs, expected.logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert list(got.top_token_ids) == list(want.top_token_ids)
        assert list(got.top_logprobs) == pytest.approx(want.top_logprobs, abs=1e-4)
    grpc_logprobs = [lp.logprob for lp in result.logprobs]

    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=2, extra_body=IGNORE_EOS
    ).choices[0]
    lp = completion.logprobs
    assert lp.token_logprobs == pytest.approx(grpc_logprobs, abs=1e-4)  # another batch: float32 sums differ
    # Each token decoded alone (so a piece of a UTF-8 character reads as U+FFFD, as vLLM's do).
    tokens = [TOKENIZER.decode([t], skip_special_tokens=False) for t in result.token_ids]
    assert lp.tokens == tokens and lp.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for token, top, logprob in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) <= 3 and top[token] == logprob  # the two most likely and the sampled one

    messages = [{"role": "user", "content": "Hello there"}]
    chat = {"model": MODEL, "messages": messages, "max_completion_tokens": MAX_TOKENS, "temperature": 0}
    chat |= {"logprobs": True, "top_logprobs": 2, "extra_body": IGNORE_EOS}
    whole = client.chat.completions.create(**chat).choices[0]
    content = whole.logprobs.content
    assert len(content) == MAX_TOKENS
    assert all(len(c.top_logprobs) == 2 for c in content)
    # Each token's own bytes: a character split across tokens is whole again once they are joined (the content
    # leaves out a character the last tokens began but never finished).
    assert b"".join(bytes(c.bytes) for c in content).decode(errors="replace").startswith(whole.message.content)
    assert all(c.token != "\ufffd" or c.bytes != list("\ufffd".encode()) for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the top token
    streamed = [
        e for chunk in client.chat.completions.create(**chat, stream=True) for e in chunk.choices[0].logprobs.content
    ]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_echo_returns_the_prompt_and_its_logprobs_computed_on_the_prefill_worker(cluster, client):
    expected = greedy_completion(PROMPT, MAX_TOKENS, logprobs=1, prompt_logprobs=1)
    assert len(expected.prompt_logprobs) == len(PROMPT) - 1
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": IGNORE_EOS}
    answer = client.completions.create(**request, echo=True, logprobs=1).choices[0]
    prompt_text = TOKENIZER.decode(PROMPT, skip_special_tokens=False)
    assert answer.text.startswith(prompt_text) and len(answer.text) > len(prompt_text)
    lp = answer.logprobs
    assert len(lp.tokens) == len(PROMPT) + MAX_TOKENS
    assert lp.tokens[: len(PROMPT)] == [TOKENIZER.decode([t], skip_special_tokens=False) for t in PROMPT]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has no context
    want = [x.logprob for x in expected.prompt_logprobs] + [x.logprob for x in expected.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    chunks = list(client.completions.create(**request, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(prompt_text)
    assert "".join(c.choices[0].text for c in chunks) == answer.text

    text = client.completions.create(**(request | {"prompt": "Once upon"}), echo=True).choices[0].text
    assert text.startswith("Once upon") and len(text) > len("Once upon")


def test_n_choices_are_n_seeded_requests_streamed_side_by_side(cluster, client):
    """Choice i is the gRPC path's answer with seed + i; usage counts the prompt once and every choice's
    tokens; a stream interleaves the choices, each chunk naming its index."""
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 11}
    answer = client.completions.create(**request, n=3, extra_body=IGNORE_EOS)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for choice in answer.choices:
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11 + choice.index, ignore_eos=True)
        assert choice.text == grpc_result(cluster, prompt_token_ids=PROMPT, sampling=sampling).text
    assert len({c.text for c in answer.choices}) > 1
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(PROMPT), 3 * MAX_TOKENS)

    chunks = list(client.completions.create(**request, n=3, stream=True, extra_body=IGNORE_EOS))
    for choice in answer.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text and mine[-1].finish_reason == "length"

    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0, n=2, extra_body=IGNORE_EOS
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same answer twice


def test_logit_bias_and_stop_token_ids_reach_both_workers(cluster, client):
    """A bias of 100 forces its token on the first token (the prefill worker's) and the rest (the decode
    worker's); a bias of -100 bans the greedy answer's first token; a stop token id ends the stream on it."""
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    expected = greedy(PROMPT, MAX_TOKENS)
    forced = client.completions.create(**request, logit_bias={"42": 100}, extra_body=IGNORE_EOS).choices[0]
    assert forced.text == TOKENIZER.decode([42] * MAX_TOKENS)
    banned = greedy(PROMPT, MAX_TOKENS, logit_bias=((expected[0], -100.0),))
    assert banned[0] != expected[0]
    text = client.completions.create(**request, logit_bias={str(expected[0]): -100}, extra_body=IGNORE_EOS)
    assert text.choices[0].text == TOKENIZER.decode(banned)
    stop = expected[3]
    stopped = client.completions.create(**request, extra_body=IGNORE_EOS | {"stop_token_ids": [stop]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == expected.index(stop) + 1  # the stop token is the last one


class Tagged(pydantic.BaseModel):
    n: int = pydantic.Field(ge=0, le=99)
    tag: Literal["red", "blue"]


def test_an_output_constraint_holds_on_both_workers(cluster, client):
    """The first token (the prefill worker's) and the rest (the decode worker's) keep to the constraint, as the
    single-process engine does: a JSON Schema through OpenAI's response_format, a regex through gRPC and HTTP alike."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["red", "blue"]}},
        "required": ["n", "tag"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "tagged", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Give me a tagged number."}]
    for seed in (1, 2, 3):
        answer = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=48, seed=seed, response_format=response_format
        ).choices[0]
        jsonschema.validate(json.loads(answer.message.content), schema)
        assert answer.finish_reason == "stop"
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, max_tokens=48, response_format=Tagged)
    tagged = parsed.choices[0].message.parsed  # the SDK's strict schema of a pydantic model, its answer read back
    assert isinstance(tagged, Tagged) and 0 <= tagged.n <= 99
    regex = "[0-9]{2}-(yes|no)"
    expected = greedy_completion(PROMPT, 16, constraint=OutputConstraint("regex", regex))
    result = grpc_result(cluster, prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=16, regex=regex))
    assert result.token_ids == expected.token_ids and re.fullmatch(regex, result.text)
    assert result.finish_reason == "stop"
    over_http = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"regex": regex}
    ).choices[0]
    assert (over_http.text, over_http.finish_reason) == (result.text, "stop")
    with pytest.raises(openai.BadRequestError, match="response_format.json_schema.schema"):
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, response_format=bad)


def test_an_output_constraint_that_fails_mid_output_ends_in_an_error_not_a_stop(cluster, client):
    """The id's pattern runs the matcher past the workers' limits on grammars once the output reaches it: the caller
    is told so, as a 400, an error event ending the stream, or INVALID_ARGUMENT, never a STOP after '{"name":"…",'
    that would read as a complete match (nor a retry: every worker has the same limits)."""
    pattern = "^(x{1000}){1301}$"
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "id": {"type": "string", "pattern": pattern}},
        "required": ["name", "id"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "late", "schema": schema}}
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=60)
    with pytest.raises(openai.BadRequestError, match="could not be held to it past"):
        client.chat.completions.create(**ask, response_format=response_format)
    streamed = ""
    with pytest.raises(openai.APIError, match="could not be held to it past"):
        for chunk in client.chat.completions.create(**ask, response_format=response_format, stream=True):
            streamed += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert streamed.startswith('{"name":"')
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        grpc_result(
            cluster, prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=60, json_schema=json.dumps(schema))
        )
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.json_schema" in failed.value.details()


def test_a_cache_salt_shares_the_prefix_cache_across_both_apis_and_only_with_its_own(cluster, client):
    """The same salt over gRPC and HTTP is one cache; another salt, or none, never hits its blocks."""
    prompt = [(7 * i) % 250 + 3 for i in range(64)]  # 4 full blocks no other test's prompt starts with
    grpc_result(cluster, prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=1), cache_salt="team-a")

    def cached(**salt: str) -> int:
        usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=salt).usage
        assert usage is not None
        return usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]

    # team-a's blocks hit: all but the last, which its last token is computed in
    assert (cached(cache_salt="team-b"), cached(), cached(cache_salt="team-a")) == (0, 0, 48)


def test_pdserve_client_takes_the_sampling_flags_of_pdserve_generate(cluster, capsys):
    flags = ["client", "--addr", cluster.address, "--prompt", "Once upon a time", "--max-tokens", str(MAX_TOKENS)]
    flags += ["--ignore-eos", "--frequency-penalty", "1.0", "--logprobs", "1", "--json"]
    assert cli.main(flags) == 0
    record = json.loads(capsys.readouterr().out)
    expected = greedy_completion(TOKENIZER.encode("Once upon a time"), MAX_TOKENS, frequency_penalty=1.0, logprobs=1)
    assert record["token_ids"] == expected.token_ids
    assert [lp["logprob"] for lp in record["logprobs"]] == pytest.approx([lp.logprob for lp in expected.logprobs])
    assert cli.main([*flags, "--top-p", "0"]) == 2  # checked before anything is sent
    assert "invalid sampling.top_p" in capsys.readouterr().err

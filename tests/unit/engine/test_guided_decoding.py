"""Constrained decoding: a request's output is a text its constraint accepts (a JSON value its schema does, any JSON
object, a regular expression's match), and ends with STOP as soon as nothing may follow; the same tokens however
its engines split it (colocated, handed from a prefill-only to a decode-only engine, migrated mid-stream)."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace

import jsonschema
import pytest
import torch

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.errors import WITHHELD, InvalidRequestError
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.output_constraint import OutputConstraint
from pdserve.protocol.outputs import FinishReason
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.test_seeded_handoff import PROMPT, colocated, engine, handed_off

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green"]},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tag", "ok"],
    "additionalProperties": False,
}


def constrained(kind: str, spec: str = "", **sampling: object) -> SamplingParams:
    return SamplingParams(max_tokens=48, constraint=OutputConstraint(kind, spec), **sampling)  # type: ignore[arg-type]


def text_of(e: LLMEngine, tokens: list[int]) -> str:
    return e.tokenizer.decode(tokens)


@pytest.mark.parametrize("seed", [None, 7])  # greedy, then sampled at temperature 1: the mask holds either way
def test_the_output_is_what_the_constraint_accepts_and_ends_there(seed):
    e = engine(EngineMode.MIXED)
    temperature = 0.0 if seed is None else 1.0
    kinds = {
        "schema": constrained("json_schema", json.dumps(SCHEMA), temperature=temperature, seed=seed),
        "regex": constrained("regex", "[0-9]{3}-(yes|no)", temperature=temperature, seed=seed),
        "object": constrained("json_object", temperature=temperature, seed=seed),
        "free": SamplingParams(max_tokens=48, temperature=temperature, seed=seed, ignore_eos=True),
    }
    completions = dict(zip(kinds, e.generate([PROMPT] * len(kinds), list(kinds.values())), strict=True))
    schema, regex = completions["schema"], completions["regex"]
    jsonschema.validate(json.loads(schema.text), SCHEMA)
    assert schema.finish_reason is FinishReason.STOP and len(schema.token_ids) < 48
    assert re.fullmatch("[0-9]{3}-(yes|no)", regex.text) and regex.finish_reason is FinishReason.STOP
    obj = completions["object"]
    assert obj.text.startswith("{")  # a random model's object may well run to max_tokens
    if obj.finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(obj.text), dict)
    free = completions["free"].text  # the same model unconstrained: the mask is what made the others so
    assert not re.fullmatch("[0-9]{3}-(yes|no)", free)


def test_the_same_tokens_colocated_handed_off_and_migrated():
    sampling = constrained("json_schema", json.dumps(SCHEMA), temperature=1.0, seed=11)
    expected = colocated(EngineRequest("a", PROMPT, sampling))
    assert handed_off(EngineRequest("a", PROMPT, sampling)) == expected
    sent = 3  # moved after three tokens: its new decode worker's matcher is fed them from the prompt's tail
    moved = EngineRequest(
        "a.2", PROMPT + expected[:sent], replace(sampling, max_tokens=48 - sent), resumed_output_tokens=sent
    )
    assert colocated(moved) == expected[sent:]
    assert handed_off(moved) == expected[sent:]


def test_a_resumed_output_that_breaks_the_constraint_is_refused_naming_no_more_than_the_token():
    """The matcher's first line, which names the token that breaks it; not its dump of the output so far and the
    grammar after it. A log line or a span keeps neither (the output is the caller's)."""
    e = engine(EngineMode.MIXED)
    digits = constrained("regex", "[0-9]{4}")
    letters = e.tokenizer.encode("ab")
    with pytest.raises(InvalidRequestError, match="resumed_output_tokens") as refused:
        e.add_request(EngineRequest("r", PROMPT + letters, digits, resumed_output_tokens=len(letters)))
    assert not e.has_unfinished()
    assert "\n" not in str(refused.value) and "[0-9]{4}" not in str(refused.value)
    assert refused.value.recorded == f"resumed_output_tokens: the output so far breaks its regex: {WITHHELD}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # float32: the copy must not be `logits` itself
@pytest.mark.parametrize("device", ["cpu", "cuda"])  # the mask as a bias, and (its torch ops run here) as bits
def test_each_constrained_row_keeps_exactly_what_its_grammar_allows_and_no_other_row_is_touched(dtype, device):
    """Rows of three grammars in different states among unconstrained ones, each row's logits its own: a constrained
    row keeps the tokens its matcher accepts next (asked token by token, not through a bitmask), the rest at -inf
    (259 tokens: the last word's three bits, and 256 in the words before, all read), a +inf logit too; every other
    row, and `logits`, stay as they were."""
    e = engine(EngineMode.MIXED)
    digits = e.guided.matcher(OutputConstraint("regex", "[0-9]{1,3}"), e.tokenizer.encode("1"))  # digits or the end
    letters = e.guided.matcher(OutputConstraint("regex", "[a-z]+!"), [])
    schema = e.guided.matcher(OutputConstraint("json_schema", json.dumps(SCHEMA)), e.tokenizer.encode('{"id":12,'))
    matchers = [None, digits, None, letters, schema, None]
    vocab = e.model_config.vocab_size
    logits = torch.randn(len(matchers), vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    letter_a = e.tokenizer.encode("a")[0]
    logits[1, letter_a] = logits[0, letter_a] = float("inf")  # fp16 logits overflow: not a digit, all the same
    given = logits.clone()
    mask = e.guided.start(matchers, torch.device(device))
    assert mask is not None
    masked = mask.masked(logits)
    assert torch.equal(logits, given) and masked.dtype == torch.float32
    for row, matcher in enumerate(matchers):
        if matcher is None:
            assert torch.equal(masked[row], logits[row].float())
            continue
        allowed = torch.tensor([matcher.validate_tokens([t]) == 1 for t in range(vocab)])
        assert 0 < int(allowed.sum()) < vocab
        assert torch.equal(masked[row, allowed], logits[row, allowed].float())
        assert bool((masked[row, ~allowed] == float("-inf")).all())
    assert masked[1, letter_a] == float("-inf") and masked[0, letter_a] == float("inf")
    assert (
        e.guided.start([None, None], torch.device(device)) is None
    )  # nothing to mask: the engine samples `logits` as they are


def test_a_steps_masks_are_started_before_its_forward(monkeypatch):
    """They depend only on the tokens each matcher has consumed: computed beside the model, not after it."""
    e = engine(EngineMode.MIXED)
    calls: list[str] = []
    start, execute = e.guided.start, e.runner.execute
    monkeypatch.setattr(e.guided, "start", lambda *args: calls.append("masks") or start(*args))
    monkeypatch.setattr(e.runner, "execute", lambda chunks: calls.append("forward") or execute(chunks))
    e.generate([PROMPT], constrained("regex", "[0-9]{3}"))
    assert calls[:4] == ["masks", "forward", "masks", "forward"]


def test_a_request_that_carries_its_compiled_grammar_is_never_compiled_on_the_engine_thread(monkeypatch):
    """The worker's handler compiles it (AsyncEngine.prepare); one dropped from the kept grammars before the request
    reaches the engine (64 kept) is not compiled again there, holding every stream."""
    e = engine(EngineMode.MIXED)
    sampling = constrained("regex", "[0-9]{3}")
    assert sampling.constraint is not None
    grammar = e.guided.compile(sampling.constraint)

    def compile_here(constraint: OutputConstraint) -> None:
        raise AssertionError("compiled on the engine thread")

    monkeypatch.setattr(e.guided, "compile", compile_here)
    e.add_request(EngineRequest("r", PROMPT, sampling, grammar=grammar))
    texts = [out.new_text for _ in range(8) for out in e.step()]
    assert re.fullmatch("[0-9]{3}", "".join(texts))


def test_prepare_gives_the_request_its_compiled_grammar():
    async_engine = AsyncEngine(engine(EngineMode.MIXED))
    try:
        plain = EngineRequest("p", PROMPT, SamplingParams(max_tokens=4))
        digits = EngineRequest("d", PROMPT, constrained("regex", "[0-9]{3}"))
        assert asyncio.run(async_engine.prepare(plain)) is plain
        prepared = asyncio.run(async_engine.prepare(digits))
        constraint = digits.sampling.constraint
        assert constraint is not None and digits.grammar is None
        assert prepared == digits and prepared.grammar is async_engine._engine.guided.compile(constraint)
    finally:
        async_engine.stop()


def test_a_grammar_is_compiled_once_and_each_request_gets_a_fresh_copy():
    """Compiling takes ~1.5 ms a KiB of schema: the worker's request handler does it off the engine thread, once per
    grammar; each request's matcher is a copy, which its tokens advance alone."""
    e = engine(EngineMode.MIXED)
    digits = OutputConstraint("regex", "[0-9]{2}")
    compiled = e.guided.compile(digits)
    assert e.guided.compile(OutputConstraint("regex", "[0-9]{2}")) is compiled  # a new request, the same grammar
    first, second = e.guided.matcher(digits, []), e.guided.matcher(digits, [])
    assert first is not compiled and second is not compiled
    first.consume_tokens(e.tokenizer.encode("12"))
    assert first.is_stopped() and not second.is_stopped() and not compiled.is_stopped()

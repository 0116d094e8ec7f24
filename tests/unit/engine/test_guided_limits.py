"""A grammar that is cheap to send but costly to follow costs a worker's steps little: it is refused where it is
compiled when its first mask fails, and fails at its first token past the limits otherwise; concurrent requests for
one grammar share one compile. SmolLM2's vocabulary: its long runs of one letter are what make these grammars
costly (a byte vocabulary walks them a byte a step)."""

from __future__ import annotations

import json
import threading
import time

import llguidance
import pytest
import torch

from pdserve.engine import guided
from pdserve.engine.guided import GuidedDecoding
from pdserve.engine.models import resolve_model
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError
from pdserve.protocol.output_constraint import OutputConstraint


@pytest.fixture(scope="module")
def smollm2() -> GuidedDecoding:
    return GuidedDecoding(Tokenizer(resolve_model("smollm2-135m")), 49152, [2])


@pytest.mark.parametrize("regex", ["[^\\s\\S]", "[^\\x00-\\U0010FFFF]"])
def test_a_grammar_no_text_matches_is_refused_by_compile_naming_its_field(smollm2, regex):
    """Its first mask fails: found in the request's handler, before its prompt runs (its output would end at once,
    as if complete)."""
    with pytest.raises(InvalidRequestError, match="fails at its start") as refused:
        smollm2.compile(OutputConstraint("regex", regex))
    assert refused.value.field == "sampling.regex"
    assert "\n" not in str(refused.value)  # the lexer's dumped state stays out of the caller's message


@pytest.mark.parametrize("regex", ["(x{500}){500}", "(x{1000}){6000}"])
def test_a_grammar_past_the_limits_fails_at_its_first_token_not_on_every_step(smollm2, regex):
    """Under llguidance's defaults `(x{500}){500}` is followed, at ~130 ms a mask every step, and `(x{1000}){6000}`'s
    first mask takes over a second; under the worker's limits each fails at the first long token."""
    matcher = smollm2.matcher(OutputConstraint("regex", regex), [])
    mask = smollm2.start([matcher], torch.device("cpu"))
    assert mask is not None
    allowed = (mask._masks.result()[0] == 0).nonzero()[0].tolist()
    matcher.consume_token(max(allowed, key=lambda t: len(smollm2.tokenizer.decode_bytes([t]))))
    assert matcher.is_error() and "too many expressions" in matcher.get_error()


REALISTIC = [
    ("json_object", ""),
    ("regex", r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}"),
    ("regex", r"(\w+ ){0,50}\w+"),
    ("regex", "x{1000}"),
    (
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "email": {"type": "string", "format": "email"},
                    "born": {"type": "string", "format": "date-time"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
                    "city": {"enum": [f"City{i}" for i in range(1500)]},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                },
                "required": ["email", "born", "zip", "city", "tags"],
            }
        ),
    ),
]


@pytest.mark.parametrize(("kind", "spec"), REALISTIC)
def test_realistic_constraints_stay_within_the_limits_as_their_outputs_grow(smollm2, kind, spec):
    """Forty tokens each, the longest allowed token every step (the runs that cost a lexer most)."""
    matcher = smollm2.matcher(OutputConstraint(kind, spec), [])
    for _ in range(40):
        mask = smollm2.start([matcher], torch.device("cpu"))
        assert mask is not None
        allowed = [t for t in (mask._masks.result()[0] == 0).nonzero()[0].tolist() if t != 2]
        if not allowed:
            break
        matcher.consume_token(max(allowed, key=lambda t: len(smollm2.tokenizer.decode_bytes([t]))))
        assert not matcher.is_error(), matcher.get_error()


def test_concurrent_compiles_of_one_grammar_share_one(smollm2, monkeypatch):
    built: list[str] = []
    real = llguidance.LLMatcher

    def slow_build(*args: object, **kwargs: object) -> llguidance.LLMatcher:
        built.append("one")
        time.sleep(0.2)  # every other thread asks while this one compiles
        return real(*args, **kwargs)

    constraint = OutputConstraint("regex", "[0-9]{7}")  # before the patch: it validates with LLMatcher
    monkeypatch.setattr(guided.llguidance, "LLMatcher", slow_build)
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(smollm2.compile(constraint))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and len(results) == 6 and all(r is results[0] for r in results)
    assert smollm2.compile(constraint) is results[0]  # and kept


def test_concurrent_compiles_of_a_refused_grammar_are_all_refused_and_none_kept(smollm2, monkeypatch):
    real = llguidance.LLMatcher

    def slow_build(*args: object, **kwargs: object) -> llguidance.LLMatcher:
        time.sleep(0.2)
        return real(*args, **kwargs)

    constraint = OutputConstraint("regex", "[^\\s\\S]")  # before the patch: it validates with LLMatcher
    monkeypatch.setattr(guided.llguidance, "LLMatcher", slow_build)
    errors: list[BaseException] = []

    def compile_it() -> None:
        try:
            smollm2.compile(constraint)
        except InvalidRequestError as e:
            errors.append(e)

    threads = [threading.Thread(target=compile_it) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 3
    assert constraint.grammar not in smollm2._compiled and constraint.grammar not in smollm2._compiling

"""Constrained decoding's constraint: what a request's whole output must be (a JSON value a schema accepts, any
JSON object, a text a regular expression matches), compiled into an llguidance grammar once, where the request is
built. A constraint that does not compile is the request's fault, refused naming its field, before any worker
sees it; the engine (engine/guided.py) masks each step's logits to the tokens the grammar allows.

JSON is compact by default (no whitespace between tokens): with whitespace allowed, a model may emit it without
end and spend max_tokens on it. A schema's `"x-guidance": {"whitespace_flexible": true}` allows it again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import llguidance

from pdserve.errors import WITHHELD, InvalidRequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

KINDS = ("json_schema", "json_object", "regex")
MAX_SPEC_BYTES = 64 * 1024  # a schema or regex past this is refused: each worker it reaches compiles it, ~1.5 ms a KiB
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


@dataclass(frozen=True)
class OutputConstraint:
    kind: str  # one of KINDS
    spec: str = ""  # the schema as JSON text, or the regular expression; "" for json_object

    def __post_init__(self) -> None:
        field = f"sampling.{self.kind}"
        if self.kind not in KINDS:
            raise InvalidRequestError("sampling", f"unknown output constraint {self.kind!r}; one of {KINDS}")
        if self.kind == "regex" and not self.spec:  # the wire reads an empty string as no constraint at all
            raise InvalidRequestError(field, "must not be empty")
        try:
            size = len(self.spec.encode())
        except UnicodeEncodeError:  # a lone surrogate: a JSON body's \ud800, a command line's undecodable byte
            raise InvalidRequestError(
                field, "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not Unicode text"
            ) from None
        if size > MAX_SPEC_BYTES:
            raise InvalidRequestError(field, f"is {size} bytes; at most {MAX_SPEC_BYTES}")
        error = llguidance.LLMatcher.validate_grammar(self.grammar)
        if error:
            raise InvalidRequestError(field, f"does not compile: {error}", f"does not compile: {WITHHELD}")

    @cached_property
    def grammar(self) -> str:
        """The llguidance grammar (its JSON text), compiled once per request."""
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        schema = self.spec if self.kind == "json_schema" else '{"type": "object"}'
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            raise InvalidRequestError(f"sampling.{self.kind}", f"is not valid JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise InvalidRequestError(f"sampling.{self.kind}", "must be a JSON Schema object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        except ValueError as e:
            withheld = f"does not compile: {WITHHELD}"
            raise InvalidRequestError(f"sampling.{self.kind}", f"does not compile: {e}", withheld) from None

"""OpenAI's `response_format`, and pdserve's `regex`, as the gRPC API's output constraint (constrained decoding):
`{"type": "text"}` asks for nothing, `{"type": "json_object"}` any JSON object, `{"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}` a JSON value its schema accepts. Strict or not, the
output is held to the schema as written, as vLLM's `response_format` holds it; OpenAI's strict mode also refuses
schemas whose objects allow keys they do not list (the SDK's pydantic models never do), which this does not.
`regex`, the gRPC field under its name: a text the regular expression matches. At most one constraint, as on the
gRPC API (the shared path refuses a second)."""

from __future__ import annotations

import json
from typing import Any

from pdserve.errors import InvalidRequestError
from pdserve.v1 import generate_pb2 as pb
from services.router.http.json_values import typed

# The shared path's names of the constraint's fields, as the OpenAI parameter that set them.
PARAMS = {"sampling.json_schema": "response_format.json_schema.schema", "sampling.json_object": "response_format"}
SCHEMA_FIELDS = {"name", "schema", "strict", "description"}
CONSTRAINTS = ("response_format", "regex")  # the parameters that set one


def set_constraint(body: dict[str, Any], msg: pb.SamplingParams) -> None:
    """The body's `response_format` and `regex` on the gRPC request, for the shared path to check and compile."""
    _set_response_format(body, msg)
    regex = typed(body, "regex", str)
    if regex == "":  # the wire's "" is no constraint at all: a caller asking for one is told, as the gRPC CLI is
        raise InvalidRequestError("regex", "must not be empty")
    msg.regex = regex or ""


def _set_response_format(body: dict[str, Any], msg: pb.SamplingParams) -> None:
    fmt = body.get("response_format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError(
            "response_format", 'must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", ...}'
        )
    if extra := set(fmt) - {"type", "json_schema" if kind == "json_schema" else "type"}:
        raise InvalidRequestError("response_format", f"{kind} takes no {', '.join(sorted(extra))}")
    if kind == "json_object":
        msg.json_object = True
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or set(spec) - SCHEMA_FIELDS:
            raise InvalidRequestError(
                "response_format.json_schema", f"must be an object with a name and a schema, of {sorted(SCHEMA_FIELDS)}"
            )
        for name, kind, article in (("strict", bool, "true or false"), ("description", str, "a string")):
            if spec.get(name) is not None and not isinstance(spec[name], kind):  # null: not given, as OpenAI reads it
                raise InvalidRequestError(f"response_format.json_schema.{name}", f"must be {article}")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema", "must be a JSON Schema object")
        # Its size near what the caller wrote: escaped to ASCII, a non-ASCII schema's would double past the cap.
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        try:
            text.encode()
        except UnicodeEncodeError:  # a lone surrogate (\ud800), which a protobuf string cannot hold
            raise InvalidRequestError(
                "response_format.json_schema.schema",
                "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not Unicode text",
            ) from None
        msg.json_schema = text

"""An OpenAI body's JSON, and its values read as the JSON type a parameter takes: any other type, a string that is no
Unicode text, a number no float holds, is refused naming the parameter (InvalidRequestError)."""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

from pdserve.errors import InvalidRequestError

INT32 = 2**31 - 1
# JSON's \u escapes can spell half of a UTF-16 pair alone: no Unicode text, and UTF-8 (protobuf, JSON out) has none.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json(body: bytes) -> object:
    """The body's JSON value; InvalidRequestError when it is none, or nests deeper than the parser recurses."""
    try:
        return json.loads(body)
    except ValueError as e:
        if "integer string conversion" in str(e):  # Python's own limit, whose text advises the server's code
            raise InvalidRequestError("body", f"a number has more than {sys.get_int_max_str_digits()} digits") from None
        raise InvalidRequestError("body", f"not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequestError("body", "nests arrays or objects too deeply") from None


def typed(body: dict[str, Any], name: str, kind: type, prefix: str = "") -> Any:
    """`body[name]` if it is of `kind` (a bool is no integer here, as in JSON), else None when not given."""
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        article = "an" if _JSON_TYPE[kind][0] in "aeiou" else "a"
        raise InvalidRequestError(prefix + name, f"must be {article} {_JSON_TYPE[kind]}, got {json_type(value)}")
    return unicode_text(value, prefix + name) if isinstance(value, str) else value


def unicode_text(value: str, name: str) -> str:
    """`value`, unless a lone surrogate makes it no Unicode text (neither protobuf nor the JSON out can carry it)."""
    if _LONE_SURROGATE.search(value):
        raise InvalidRequestError(name, "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not Unicode text")
    return value


def number(body: dict[str, Any], name: str, prefix: str = "") -> float | None:
    """A finite float: NaN and Infinity (Python's JSON reads them) are refused, and so is an integer past a float's
    range (JSON's integers have no bound)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(prefix + name, f"must be a finite number, got {json_type(value)}")
    try:
        as_float = float(value)
    except OverflowError:
        raise InvalidRequestError(prefix + name, "must be a finite number, got an integer too large for one") from None
    if not math.isfinite(as_float):
        raise InvalidRequestError(prefix + name, f"must be a finite number, got {as_float}")
    return as_float


def integer(body: dict[str, Any], name: str, low: int = -INT32 - 1, high: int = INT32) -> int | None:
    """An integer in [low, high] (an int32 unless told), or None when not given."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():  # 3.0, as some JSON writers send 3: vLLM (pydantic) takes it
        value = int(value)
    if not is_int(value):
        got = f"{value:g}" if isinstance(value, float) else json_type(value)
        raise InvalidRequestError(name, f"must be an integer, got {got}")
    if not low <= value <= high:
        raise InvalidRequestError(name, f"must be in [{low}, {high}], got {value}")
    return int(value)


def is_int(value: object) -> bool:
    """JSON's integers: Python's bool is an int, JSON's true is not."""
    return isinstance(value, int) and not isinstance(value, bool)


_JSON_TYPE = {str: "string", bool: "boolean", dict: "object", list: "array", int: "integer", float: "number"}


def json_type(value: object) -> str:
    """The JSON type's name of a parsed value, for an error saying what came instead."""
    return next((name for kind, name in _JSON_TYPE.items() if isinstance(value, kind)), type(value).__name__)

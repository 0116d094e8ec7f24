"""The shared path's typed errors as OpenAI-shaped HTTP errors: status, type, param, code, retry headers."""

from __future__ import annotations

import pytest

from pdserve.errors import (
    InvalidRequestError,
    MissingKeyError,
    OverloadedError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
)
from services.router.generation import ModelNotFoundError
from services.router.http.errors import error_body


@pytest.mark.parametrize(
    ("exc", "status", "kind", "param", "code"),
    [
        (InvalidRequestError("sampling.top_p", "must be in (0, 1]"), 400, "invalid_request_error", "top_p", None),
        (ModelNotFoundError("not served"), 404, "invalid_request_error", "model", "model_not_found"),
        (MissingKeyError("no key"), 401, "invalid_request_error", None, None),  # OpenAI's code is null for none
        (UnauthenticatedError("unknown API key"), 401, "invalid_request_error", None, "invalid_api_key"),
        (PermissionDeniedError("priority", "above the key's cap"), 403, "permission_error", "priority", None),
        (UnavailableError("draining"), 503, "service_unavailable_error", None, None),
        (TimeoutError("deadline"), 504, "timeout_error", None, None),
        (RuntimeError("bug"), 500, "internal_error", None, None),
    ],
)
def test_each_error_has_its_status_and_shape(exc, status, kind, param, code):
    got, body, headers = error_body(exc)
    assert (got, body["error"]["type"], body["error"]["param"], body["error"]["code"]) == (status, kind, param, code)
    assert headers == ({"x-should-retry": "false"} if status == 500 else {})  # the SDK would retry a bug twice


def test_a_bug_answers_500_without_its_text():
    status, body, _ = error_body(RuntimeError("/secret/path failed for tenant-b"))
    assert status == 500 and "secret" not in body["error"]["message"]
    assert body["error"]["message"].startswith("internal error (error id ")


def test_a_missing_key_is_told_to_send_the_http_header_not_grpc_metadata():
    _, body, _ = error_body(MissingKeyError("this cluster requires an API key: send metadata `authorization: ...`"))
    assert body["error"]["message"].endswith("send the header `Authorization: Bearer KEY`")


def test_a_bad_field_reads_as_the_openai_parameter_the_body_used():
    _, body, _ = error_body(InvalidRequestError("sampling.max_tokens", "too many"), "max_completion_tokens")
    assert body["error"]["message"] == "max_completion_tokens: too many"


@pytest.mark.parametrize(("ms", "seconds"), [(100, "1"), (1000, "1"), (1001, "2"), (30_000, "30")])
def test_shed_carries_both_retry_hints(ms, seconds):
    status, body, headers = error_body(OverloadedError("prefill queue full", ms))
    assert (status, body["error"]["code"]) == (429, "rate_limit_exceeded")
    assert headers == {"retry-after": seconds, "retry-after-ms": str(ms)}

"""CORS for the HTTP API: which browser pages may call it, and what they may read of its answers. Starlette's
CORSMiddleware does the protocol; this module only decides what it allows.

Placed outside everything that answers, so that every response carries the headers, an error's above all (a 401,
429 or 503 a browser would otherwise hide behind a network error) and even the 500 of a bug, which Starlette's
own error middleware sends. A preflight needs no API key: a browser never sends one on it, and it reaches no
route. The request that follows reaches its route, which checks the key as for any other caller."""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from pdserve.config import RouterConfig
from pdserve.security.cors_origins import subdomain_pattern

ALLOWED_METHODS = ("GET", "POST")  # the API's own; a preflight asking for another is refused
# What a client reads of a response beyond the headers every page may read (Content-Type and the like): the id
# OpenAI's SDK reports as `request_id`, the retry hints its retries wait for and obey, the router's TTFT prediction.
EXPOSED_HEADERS = ("x-request-id", "retry-after", "retry-after-ms", "x-should-retry", "x-pdserve-predicted-ttft-ms")
PREFLIGHT_MAX_AGE_S = 600  # how long a browser may keep a preflight's answer for a URL (Chrome keeps 2 h at most)


def with_cors(app: ASGIApp, config: RouterConfig) -> ASGIApp:
    """`app` answering the origins `config` allows; `app` itself when it allows none (no CORS header at all).

    Any request header is allowed (a preflight's list is echoed back): the router reads only Authorization,
    Content-Type, Content-Encoding and X-Request-Id and ignores the rest, so a fixed list would guard nothing,
    while the OpenAI SDK sends headers of its own (X-Stainless-Retry-Count, -Timeout, -OS, ..., OpenAI-Project)
    whose set grows with its versions: a list would break a browser client on its next update."""
    if not config.http_cors_origins:
        return app
    return CORSMiddleware(
        app,
        allow_origins=config.http_cors_origins,
        allow_origin_regex=subdomain_pattern(config.http_cors_origins),
        allow_methods=ALLOWED_METHODS,
        allow_headers=["*"],
        allow_credentials=config.http_cors_allow_credentials,
        expose_headers=EXPOSED_HEADERS,
        max_age=PREFLIGHT_MAX_AGE_S,
    )
